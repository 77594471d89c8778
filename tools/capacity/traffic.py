"""The traffic kinds capacity is measured on: a window of a real Azure 2023 trace, thinned to a fixed set of
requests, with lengths scaled explicitly; the arrival rate is varied by playing that window faster.

The search variable is the *rate scale* x: the arrival rate as a multiple of the trace's own. A kind thins its
window once (keep each request with probability `thin`, seeded) and plays it `x / thin` times faster, so every
probe of one seed replays the same requests (at least `min_requests`) and only their spacing changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tools.capacity.conversations import Conversations, plan_turns
from tools.replay.client import Planned
from tools.replay.paths import repo_path
from tools.replay.traces import Shaping, TraceRequest, read_trace
from tools.replay.workload import plan

TRACES = "../shared/data/traces"


# A turn's prompt joins its conversation's messages and answers with newlines, and BPE merges at the joins: its
# tokens may pass the context its conversation counted by a few (<= 5 over seeds 0-2 of chat-kv).
CHAT_SLACK = 16

# How `Traffic.variant` names a thinned variant of a kind (e.g. conv-thin0.0375).
VARIANT_MARK = "-thin"


@dataclass(slots=True, frozen=True)
class Traffic:
    name: str
    trace: str  # relative to the repository root
    what: str
    window_start_s: float
    window_s: float
    thin: float  # share of the window's requests kept (seeded)
    prompt_scale: float
    prompt_clip: tuple[int, int]
    output_scale: float
    output_clip: tuple[int, int]
    start_rate_scale: float  # where a search starts (a guess; bisection does the rest)
    min_requests: int = 200
    # Multi-turn: the requests dealt into conversations (seeded), each turn resending the conversation so far.
    conversations: Conversations | None = None

    def shaping(self, rate_scale: float, seed: int) -> Shaping:
        if rate_scale <= 0:
            raise ValueError(f"rate scale must be > 0, got {rate_scale}")
        return Shaping(
            self.window_start_s,
            self.window_s,
            self.thin,
            rate_scale / self.thin,
            self.prompt_scale,
            self.output_scale,
            self.prompt_clip,
            self.output_clip,
            seed,
        )

    def requests(self, rate_scale: float, seed: int) -> tuple[list[TraceRequest], Shaping]:
        shaping = self.shaping(rate_scale, seed)
        reqs = shaping.apply(_trace(self.trace))
        if len(reqs) < self.min_requests:
            raise ValueError(
                f"traffic {self.name!r} seed {seed}: {len(reqs)} requests, fewer than "
                f"{self.min_requests}; raise `thin` or the window"
            )
        return reqs, shaping

    def planned(self, rate_scale: float, seed: int, prompts) -> tuple[list[Planned], Shaping]:
        """What a probe sends: one request per trace request, with its prompt (`prompts`: PromptSource); a
        multi-turn kind deals them into conversations first, by the same seed, so the turns, their text and their
        priorities do not depend on the rate scale either."""
        reqs, shaping = self.requests(rate_scale, seed)
        if self.conversations is None:
            return plan(reqs, prompts), shaping
        out = plan_turns(self.conversations.turns(reqs, seed), prompts, self.conversations.closed_loop)
        big = max(p.prompt_tokens + p.output_tokens for p in out)
        if big > self.max_tokens():
            raise ValueError(
                f"traffic {self.name!r} seed {seed}: a turn holds {big} tokens, more than the "
                f"{self.max_tokens()} its pools are checked against; raise CHAT_SLACK"
            )
        return out, shaping

    def max_tokens(self) -> int:
        """The most KV tokens one request can hold (its clipped prompt and output; a turn: its context)."""
        one = self.prompt_clip[1] + self.output_clip[1]
        return one if self.conversations is None else max(one, self.conversations.max_context_tokens + CHAT_SLACK)

    @staticmethod
    def is_variant(name: str) -> bool:
        """Whether a stored traffic name is a thinned variant of a kind (named by `variant`)."""
        return VARIANT_MARK in name

    def variant(self, thin: float, min_requests: int) -> "Traffic":
        """The same kind thinned differently (fewer requests per probe: a quicker, coarser measurement); its
        name says so, so its probes are stored apart from the kind's own."""
        if not 0 < thin <= 1 or min_requests < 1:
            raise ValueError(f"thin must be in (0, 1] and min_requests >= 1, got {thin}, {min_requests}")
        return replace(self, name=f"{self.name}{VARIANT_MARK}{thin:g}", thin=thin, min_requests=min_requests)

    def describe(self) -> str:
        chat = "" if self.conversations is None else f"; {self.conversations.describe()}"
        return (
            f"{self.name}: {self.what}; at least {self.min_requests} requests per probe; {self.trace} window [{self.window_start_s:g} s, "
            f"{self.window_start_s + self.window_s:g} s), thinned x{self.thin:g} (seeded), played x(rate scale / "
            f"{self.thin:g}) faster; prompt tokens x{self.prompt_scale:g} clipped to {self.prompt_clip[0]}:"
            f"{self.prompt_clip[1]}, output tokens x{self.output_scale:g} clipped to {self.output_clip[0]}:"
            f"{self.output_clip[1]}{chat}"
        )


_TRACE_CACHE: dict[str, list[TraceRequest]] = {}


def _trace(path: str) -> list[TraceRequest]:
    if path not in _TRACE_CACHE:
        _TRACE_CACHE[path] = read_trace(repo_path(path))
    return _TRACE_CACHE[path]


# NOTE: lengths are scaled to what a 135M model on two CPU cores serves; the ratio of output to prompt
# tokens is what makes a kind decode- or prefill-heavy, so each kind keeps its trace's character:
# conversation outputs (median 181 in this window, p90 ~424) x0.125 -> median 24, and the clip (112) lies above
# the scaled p90 (~53), so outputs are scaled, not clipped, for 99% of requests; prompts (median 1042) x0.03.
# A request holds at most 128 + 112 = 240 tokens, so it fits the smallest pool mapped (256 tokens) alone.
# The code trace keeps its tiny outputs (median 14) and long prompts (x0.05: median 66).
# `conv-kv` is the same window with requests that hold real KV (docs/benchmarks.md): outputs x0.55 (median 92-116
# over seeds 0-4, p90 ~235), prompts x0.1 (median ~105, clipped at 256 for 10%), so a request holds median
# 250-300 tokens (p10 ~87, p90 ~350) and at most 640. It is the traffic KV capacity binds on, as in the paper.
# `conv-kv-hour` is conv-kv's lengths over the whole trace hour, whose own rate swings 2.6x (191-507 requests a
# minute, peak at minutes 26-36): the load a dynamic policy is meant for, where a static one pays its quality
# loss on every token and the dynamic one only while the peak lasts (docs/capacity.md, "over an hour").
KINDS = {
    "conv-kv": Traffic(
        "conv-kv",
        f"{TRACES}/azure_llm_conv_2023.csv",
        "Azure 2023 conversation trace, decode-heavy, requests holding real KV",
        window_start_s=600.0,
        window_s=600.0,
        thin=0.075,
        prompt_scale=0.1,
        prompt_clip=(16, 256),
        output_scale=0.55,
        output_clip=(8, 384),
        start_rate_scale=0.1,
    ),
    "conv-kv-hour": Traffic(
        "conv-kv-hour",
        f"{TRACES}/azure_llm_conv_2023.csv",
        "Azure 2023 conversation trace, the whole hour with its own rate swings, requests holding real KV",
        window_start_s=0.0,
        window_s=3510.0,
        thin=0.02,
        prompt_scale=0.1,
        prompt_clip=(16, 256),
        output_scale=0.55,
        output_clip=(8, 384),
        start_rate_scale=0.08,
    ),
    "conv": Traffic(
        "conv",
        f"{TRACES}/azure_llm_conv_2023.csv",
        "Azure 2023 conversation trace, decode-heavy",
        window_start_s=600.0,
        window_s=600.0,
        thin=0.075,
        prompt_scale=0.03,
        prompt_clip=(8, 128),
        output_scale=0.125,
        output_clip=(4, 112),
        start_rate_scale=0.3,
    ),
    "code": Traffic(
        "code",
        f"{TRACES}/azure_llm_code_2023.csv",
        "Azure 2023 code trace, prefill-heavy and bursty",
        window_start_s=2160.0,
        window_s=150.0,
        thin=0.33,
        prompt_scale=0.05,
        prompt_clip=(16, 128),
        output_scale=1.0,
        output_clip=(4, 64),
        start_rate_scale=0.5,
    ),
}

# `chat-kv` is conv-kv's requests dealt into conversations (tools/capacity/conversations.py): a request starts one
# with probability 1/4, else continues a random open one, and a turn resends the conversation so far (up to 1024
# tokens with its output), so a turn holds median ~430 tokens (p90 ~900; conv-kv ~280) and most of its prompt is
# a prefix an earlier turn prefilled: the traffic prefix reuse can pay on. `chat-kv-mixed` gives 20% of the
# conversations priority 0 (interactive) and the rest 5 (batch); its probes pass on all requests' attainment, as
# every kind's, with each class's beside it in the report.
CHAT = Conversations(mean_turns=4.0, max_context_tokens=1024)
KINDS["chat-kv"] = replace(
    KINDS["conv-kv"],
    name="chat-kv",
    start_rate_scale=0.05,
    conversations=CHAT,
    what="conv-kv's requests as the turns of multi-turn chats, each resending its history",
)
KINDS["chat-kv-mixed"] = replace(
    KINDS["chat-kv"],
    name="chat-kv-mixed",
    conversations=replace(CHAT, interactive_share=0.2),
    what="chat-kv with 20% of the conversations interactive, the rest batch",
)


# `chat-kv-closed` is chat-kv played by a chat client: a turn waits for the previous turn's answer and resends it
# (closed loop within a conversation; conversations still start when the trace says), so the blocks the server
# generated are reusable too. Its turns, lengths and messages are chat-kv's.
KINDS["chat-kv-closed"] = replace(
    KINDS["chat-kv"],
    name="chat-kv-closed",
    conversations=replace(CHAT, closed_loop=True),
    what="chat-kv played by a chat client that resends the server's own answers",
)


def kinds(names: str) -> list[Traffic]:
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in KINDS:
            raise ValueError(f"unknown traffic kind {name!r} (known: {', '.join(KINDS)})")
        out.append(KINDS[name])
    if not out:
        raise ValueError("no traffic kind given")
    return out
