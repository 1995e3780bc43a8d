"""How ``ninfer generate`` and ``ninfer chat`` print a reply: answer text to stdout as it arrives,
reasoning apart from it (on stderr between ``[reasoning]`` markers, dimmed on a terminal, or not at all).
A streamed reply prints exactly what the same reply printed at the end would."""
from __future__ import annotations

import json
import sys
from typing import Any, TextIO

DIM, RESET = "\x1b[2m", "\x1b[0m"


class ReplyPrinter:
    """Prints one reply's deltas (``on_delta``) or its whole :class:`~ninfer.Completion` (``whole``).

    ``reasoning``: where the thinking goes: "stderr" (between markers), "dim" (stdout, ANSI dim) or
    "hide". Call :meth:`close` after the last delta.
    """

    def __init__(self, reasoning: str = "stderr", out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.mode = reasoning
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.in_reasoning = False
        self.started = False  # whether anything of the reply is on stdout

    def on_delta(self, delta: Any) -> None:
        if delta.reasoning:
            self._reasoning(delta.reasoning)
        if delta.text:
            self._end_reasoning()
            self.out.write(delta.text)
            self.out.flush()
            self.started = True

    def whole(self, completion: Any) -> None:
        if completion.reasoning:
            self._reasoning(completion.reasoning)
        self._end_reasoning()
        self.out.write(completion.text)

    def close(self, completion: Any) -> None:
        """End the reply: the closing marker, the newline after the answer and one JSON line per tool call."""
        self._end_reasoning()
        self.out.write("\n")
        for call in completion.tool_calls:  # parsed out of the answer text: one JSON object per call
            self.out.write(json.dumps({"tool_call": {"name": call.name, "arguments": call.arguments}},
                                      ensure_ascii=False) + "\n")
        self.out.flush()

    def abandon(self) -> None:
        """End a reply that failed half-way, so that what follows starts on a line of its own."""
        self._end_reasoning()
        if self.started:
            self.out.write("\n")
        self.out.flush()

    def _reasoning(self, text: str) -> None:
        if self.mode == "hide":
            return
        stream = self.err if self.mode == "stderr" else self.out
        self.started |= stream is self.out
        if not self.in_reasoning:
            stream.write("[reasoning]\n" if self.mode == "stderr" else DIM)
            self.in_reasoning = True
        stream.write(text)
        stream.flush()

    def _end_reasoning(self) -> None:
        if not self.in_reasoning:
            return
        self.in_reasoning = False
        if self.mode == "stderr":
            self.err.write("\n[/reasoning]\n")
            self.err.flush()
        else:
            self.out.write(RESET + "\n")


def report(llm: Any, completion: Any) -> str:
    """The statistics line (and memory plan) printed after a reply."""
    import torch

    n = len(completion.token_ids)
    prefill_rate = completion.prompt_tokens / completion.ttft_s if completion.ttft_s else 0.0
    memory = f"\nmemory: {llm.engine.plan.describe(llm.engine.config.page_size)}"
    if llm.device.type == "cuda":
        memory += f", GPU peak {torch.cuda.max_memory_allocated(llm.device) / (1 << 30):.2f} GiB"
    spec = ""
    if completion.speculation is not None:
        st = completion.speculation
        per_position = " ".join(f"{p:.2f}" for p in st["acceptance_per_position"])
        spec = (f"\nspeculation: {st['rounds']} rounds, {st['accepted']}/{st['drafted']} drafts accepted "
                f"({100 * st['acceptance_rate']:.1f}%), {st['tokens_per_round']:.2f} tok/round, "
                f"per position [{per_position}]")
    return (f"prompt {completion.prompt_tokens} tok | generated {n} tok ({completion.finish_reason}) | "
            f"TTFT {completion.ttft_s * 1000:.1f} ms ({prefill_rate:.0f} tok/s prefill) | "
            f"decode {completion.decode_tokens_per_s:.1f} tok/s{spec}{memory}")
