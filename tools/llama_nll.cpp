// llama.cpp's next-token negative log-likelihoods for given token ids (tools/peer_perplexity.py builds and runs it).
//
//   llama-nll MODEL.gguf IDS.txt THREADS      IDS.txt: one window a line, token ids separated by spaces
//   llama-nll --tokenize MODEL.gguf TEXT.txt  llama.cpp's own ids for a text (no BOS), one line
//
// Each window is decoded alone from an empty cache, with logits for every position, as llama-perplexity does
// for its chunks; but every position is scored (not only the second half) and the ids are the caller's, so
// the tokens scored are exactly the caller's. Output, one line per window: "nll <index> <nll_1> ... <nll_{L-1}>"
// (natural log, log-softmax in double over the fp32 logits).
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static llama_model * load(const char * path) {
    llama_model_params mp = llama_model_default_params();
    // No repacked (AMX) weight copies: that kernel dies with SIGILL on these VMs. The plain path does the same
    // math: Q4_1 x Q8_1 (activations quantized per 32), Q8_0 x Q8_0 for the tied head.
    mp.use_extra_bufts = false;
    llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) { fprintf(stderr, "llama-nll: cannot load %s\n", path); exit(1); }
    return model;
}

static int tokenize(const char * model_path, const char * text_path) {
    llama_model * model = load(model_path);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::ifstream in(text_path, std::ios::binary);
    std::stringstream ss; ss << in.rdbuf();
    const std::string text = ss.str();
    std::vector<llama_token> ids(text.size() + 16);
    int n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), ids.data(), (int32_t) ids.size(), false, false);
    if (n < 0) { fprintf(stderr, "llama-nll: tokenize failed (%d)\n", n); return 1; }
    for (int i = 0; i < n; ++i) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    llama_model_free(model);
    return 0;
}

int main(int argc, char ** argv) {
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    if (argc == 4 && std::string(argv[1]) == "--tokenize") return tokenize(argv[2], argv[3]);
    if (argc != 4) { fprintf(stderr, "usage: llama-nll MODEL IDS THREADS | --tokenize MODEL TEXT\n"); return 2; }

    std::vector<std::vector<llama_token>> windows;
    std::ifstream in(argv[2]);
    for (std::string line; std::getline(in, line);) {
        std::istringstream ls(line);
        std::vector<llama_token> w;
        for (llama_token t; ls >> t;) w.push_back(t);
        if (!w.empty()) windows.push_back(w);
    }
    if (windows.empty()) { fprintf(stderr, "llama-nll: no windows in %s\n", argv[2]); return 2; }
    size_t L = 0;
    for (auto & w : windows) L = w.size() > L ? w.size() : L;

    llama_model * model = load(argv[1]);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t) L;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = atoi(argv[3]);
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "llama-nll: cannot create a context of %zu\n", L); return 1; }
    printf("info n_vocab %d add_bos %d windows %zu max_len %zu\n", n_vocab, (int) llama_vocab_get_add_bos(vocab),
           windows.size(), L);

    llama_batch batch = llama_batch_init((int32_t) L, 0, 1);
    for (size_t w = 0; w < windows.size(); ++w) {
        const auto & ids = windows[w];
        for (auto t : ids) {
            if (t < 0 || t >= n_vocab) { fprintf(stderr, "llama-nll: token %d out of range\n", t); return 2; }
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = (int32_t) ids.size();
        for (size_t i = 0; i < ids.size(); ++i) {
            batch.token[i] = ids[i];
            batch.pos[i] = (llama_pos) i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama-nll: decode failed at window %zu\n", w); return 1; }
        printf("nll %zu", w);
        for (size_t i = 0; i + 1 < ids.size(); ++i) {
            const float * lg = llama_get_logits_ith(ctx, (int32_t) i);
            double mx = lg[0];
            for (int v = 1; v < n_vocab; ++v) mx = lg[v] > mx ? lg[v] : mx;
            double sum = 0.0;
            for (int v = 0; v < n_vocab; ++v) sum += std::exp(lg[v] - mx);
            printf(" %.9g", mx + std::log(sum) - lg[ids[i + 1]]);
        }
        printf("\n");
        fflush(stdout);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
