"""Multi-turn traffic (issue 45, item 4): the trace's requests dealt into conversations whose every turn resends
the whole conversation so far, as a chat client does, so most prompt tokens are a prefix some earlier request
computed; and a mixed-priority variant (an interactive share of the conversations at one priority, the rest at a
less important one).

The trace gives each turn its arrival, its new message's length (the request's scaled prompt length) and its
output length. Two clients:
- open loop (`closed_loop=False`): a turn's prompt carries a stand-in for the previous answer (corpus text of the
  length that turn was asked to generate), not the answer the server gave, so the prefix a server can reuse is
  the previous prompt only;
- a chat client (`closed_loop=True`): a turn waits for the previous turn's answer and resends it as the server
  streamed it (text, re-tokenized by the server as any chat client's history is), so the blocks the server
  generated can be reused too. The replay client joins the turns (tools.replay.runner, `Planned.follows`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tools.replay.client import Planned, chat_turn
from tools.replay.traces import TraceRequest

INTERACTIVE, BATCH = 0, 5  # the priorities of the mixed variant (lower is more important)


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: int
    turn: int  # 0 for the first message
    arrival_s: float
    message_tokens: int  # the new user message
    output_tokens: int
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Conversations:
    mean_turns: float = 4.0  # a request starts a new conversation with probability 1 / mean_turns
    max_context_tokens: int = 512  # a turn whose prompt + output would pass it starts a new conversation instead
    interactive_share: float | None = None  # mixed variant: share of conversations at INTERACTIVE, the rest BATCH
    closed_loop: bool = False  # a chat client: each turn resends the server's own previous answer

    def __post_init__(self):
        if self.mean_turns < 1:
            raise ValueError(f"mean_turns must be >= 1, got {self.mean_turns}")
        if self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {self.max_context_tokens}")
        if self.interactive_share is not None and not 0 <= self.interactive_share <= 1:
            raise ValueError(f"interactive_share must be in [0, 1], got {self.interactive_share}")

    def turns(self, reqs: list[TraceRequest], seed: int) -> list[Turn]:
        """Each request, in arrival order, continues a random open conversation or starts one (seeded). The classes
        are drawn from a stream of their own, so the mixed variant's conversations are the plain one's."""
        rng, classes = random.Random(seed), random.Random(f"classes-{seed}")
        context: dict[int, int] = {}  # open conversation -> tokens of its prompt so far (messages and answers)
        count: dict[int, int] = {}
        priority: dict[int, int] = {}
        out = []
        for r in sorted(reqs, key=lambda r: r.arrival_s):
            conv = rng.choice(list(context)) if context and rng.random() >= 1 / self.mean_turns else None
            if conv is not None and context[conv] + r.prompt_tokens + r.output_tokens > self.max_context_tokens:
                del context[conv]  # full: it ends, and this request starts another
                conv = None
            if conv is None:
                conv = len(count)
                context[conv], count[conv] = 0, 0
                share = self.interactive_share
                priority[conv] = 0 if share is None else (INTERACTIVE if classes.random() < share else BATCH)
            out.append(Turn(conv, count[conv], r.arrival_s, r.prompt_tokens, r.output_tokens, priority[conv]))
            context[conv] += r.prompt_tokens + r.output_tokens
            count[conv] += 1
        return out

    def describe(self) -> str:
        mixed = (
            ""
            if self.interactive_share is None
            else f"; {self.interactive_share:.0%} of conversations interactive (priority {INTERACTIVE}), the rest batch "
            f"(priority {BATCH})"
        )
        answers = (
            "the server's own previous answers, each turn sent once the previous one ended (closed loop)"
            if self.closed_loop
            else "previous answers as corpus stand-ins"
        )
        return (
            f"multi-turn: a request starts a conversation with probability 1/{self.mean_turns:g}, else continues "
            f"a random open one; a turn resends the conversation so far ({answers}) "
            f"up to {self.max_context_tokens} tokens with its output{mixed}"
        )


def plan_turns(turns: list[Turn], prompts, closed_loop: bool = False) -> list[Planned]:
    """Prompts for the turns: conversation c's message and stand-in answer of turn t are corpus text at their own
    offsets (`prompts`: tools.replay.prompts.PromptSource), and a turn's prompt is every earlier message and
    answer of its conversation, then its own message. `closed_loop`: a later turn carries only its message and
    follows its conversation's previous turn (the client adds the history and the server's answer when it
    sends it); its prompt_tokens stay the stand-in's count, an estimate (the answer has the same forced length)."""
    history: dict[int, str] = {}
    last: dict[int, int] = {}  # conversation -> its previous turn's index
    out = []
    for i, t in enumerate(turns):
        message, _ = prompts.prompt(2 * (1000 * t.conversation + t.turn), t.message_tokens)
        answer, _ = prompts.prompt(2 * (1000 * t.conversation + t.turn) + 1, t.output_tokens)
        prompt = history.get(t.conversation, "") + message
        n = len(prompts.tok.encode(prompt))
        follows = last.get(t.conversation) if closed_loop else None
        out.append(
            Planned(i, t.arrival_s, message if follows is not None else prompt, n, t.output_tokens, t.priority, follows)
        )
        # NOTE: the open loop's stand-in answer starts on a line of its own (the prompts planned before the
        # closed loop existed, kept so that their probes replay the same text).
        history[t.conversation] = chat_turn(prompt, "\n" + answer, "")
        last[t.conversation] = i
    return out
