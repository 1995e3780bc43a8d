"""The engine's settings: lanes, context and KV capacity, chunking, prefix cache, speculation, host memory.

This dataclass is the one definition of the engine options: each field's metadata holds the
:class:`~ninfer.runtime.options.Option` users set it with (default, help, unit, check).
``ninfer.load(**options)`` builds the config with :meth:`EngineConfig.from_options`, and the commands
generate their flags from the same options (``ninfer.cli_options``). Fields without an option
(``max_pending``) are for the server, which builds the config
itself.

The defaults are those a vLLM or SGLang user expects of a server that batches: several lanes
(4) and a context long enough for ordinary chats and tool use (8192 tokens; both engines default
to the model's full context, which ninfer would have to reserve up front).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.runtime.options import (
    GIB,
    Option,
    OptionError,
    at_least,
    between,
    gib_to_bytes,
    option,
    options_of,
    resolve,
)
from ninfer.runtime.stall_budget import StallBound

MAX_LANES = 8  # the scheduler's bound on max_concurrency
MAX_DRAFT_TOKENS = 7  # verification runs K + 1 <= 8 tokens per sequence through the decode kernels
DEFAULT_DRAFT_TOKENS = 3

_SPEC = Option("spec", None, "speculative decoding with the checkpoint's MTP head", kind=str,
               choices=(None, "mtp"), metavar="mtp")
_DRAFT = Option("draft_tokens", DEFAULT_DRAFT_TOKENS, f"tokens drafted per speculative round, 1-{MAX_DRAFT_TOKENS}",
                check=between(1, MAX_DRAFT_TOKENS), needs="spec", metavar="K")


_DRAFT_VOCAB = Option("draft_vocab", None, "draft only among the N lowest token ids (byte-level BPE numbers tokens in "
                      "merge order, frequent ones first): the drafts' LM head reads N rows instead of the whole "
                      "vocabulary; acceptance may drop", check=at_least(1), needs="spec", metavar="N")
_TOKEN_MAP = Option("draft_token_map", None, "draft only among the token ids listed in FILE (a torch.save'd tensor, "
                    "as SGLang's --speculative-token-map, a JSON list or whitespace-separated ids)", kind=str,
                    check=lambda path: None if os.path.isfile(path) else "must name an existing file",
                    needs="spec", metavar="FILE")


def _draft_tokens(values: Mapping[str, Any]) -> int:
    return values["draft_tokens"] if values["spec"] else 0


def _draft_vocab(values: Mapping[str, Any]) -> int | str | None:
    if values["draft_vocab"] is not None and values["draft_token_map"] is not None:
        raise OptionError("draft_vocab (--draft-vocab) and draft_token_map (--draft-token-map) are alternatives: "
                          "give one")
    return values["draft_vocab"] if values["draft_vocab"] is not None else values["draft_token_map"]


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = option(Option(
        "max_concurrency", 4, f"sequences decoded together, 1-{MAX_LANES}", check=between(1, MAX_LANES),
        metavar="N"))
    max_context: int = option(Option(
        "max_context", 8192, "most tokens per sequence, prompt + output", check=at_least(2), metavar="N"))
    kv_capacity: int | str | None = option(Option(
        "kv_capacity", None, "KV pool size in tokens, or 'auto' to fill free GPU memory (default: "
        "max-concurrency x max-context)", check=at_least(1), literals=("auto", None), metavar="N|auto"))
    kv_dtype: str = option(Option(
        "kv_dtype", "auto", "KV cache storage; auto: the model dtype", kind=str,
        choices=("auto", "bf16", "fp8", "int8")))
    prefill_chunk: int = option(Option(
        "prefill_chunk", 8192, "most prompt tokens per step while no sequence decodes (one chunk of a long "
        "prompt)", check=at_least(1), metavar="N"))
    prefill_tokens_while_decoding: int = option(Option(
        "prefill_tokens_while_decoding", 1024, "most prompt tokens per step while sequences decode: bounds their "
        "stall (at most prefill-chunk); 256 or fewer also replays such chunks from a CUDA graph (smoothest: 128)",
        check=at_least(1), metavar="N"))
    max_decode_stall: str | None = option(Option(
        "max_decode_stall", None, "bound each step that prefills beside decoding sequences by time: '40ms', or "
        "'3x' a decode step; its prompt tokens then follow from measured step times (prefill-tokens-while-"
        "decoding is only the first guess)", kind=str, check=StallBound.problem, literals=(None,), metavar="MS|Nx"))
    cuda_graphs: bool = option(Option(
        "cuda_graphs", True, "replay decode steps from CUDA graphs", kind=bool,
        flag_help="run decode steps eagerly, without CUDA graphs"))
    decode_ahead: bool = option(Option(
        "decode_ahead", True, "launch each decode step before the tokens of the one before reach the host, so "
        "the host's work (text, stops, the next step's inputs) overlaps the GPU's (vLLM's async scheduling); "
        "never with speculation", kind=bool,
        flag_help="wait for each decode step's tokens before launching the next"))
    page_size: int = option(Option(
        "page_size", 64, "tokens per KV page (vLLM's block size)", check=at_least(1), metavar="N"))
    max_pending: int = 64  # the wait queue; the server widens it to its own admission limit
    prefix_cache: bool = option(Option(
        "prefix_cache", True, "reuse the KV pages and DeltaNet state of earlier prompts", kind=bool,
        flag_help="do not reuse the KV pages and DeltaNet state of earlier prompts"))
    checkpoint_slots: int = option(Option(
        "checkpoint_slots", 8, "DeltaNet state checkpoints kept for prefix reuse, beyond the lanes",
        check=at_least(1), needs="prefix_cache", metavar="N"))
    checkpoint_interval: int = option(Option(
        "checkpoint_interval", 4096, "also checkpoint every N tokens of a long prompt", check=at_least(1),
        needs="prefix_cache", metavar="N"))
    host_cache_bytes: int = option(Option(
        "host_cache_gib", 0.0, "pinned host memory that evicted prefix checkpoints move to and are restored "
        "from (0: evicted checkpoints are dropped)", kind=float, check=at_least(0), to_field=gib_to_bytes,
        needs="prefix_cache", metavar="GIB"))
    draft_tokens: int = dataclasses.field(default=0, metadata={"options": (_SPEC, _DRAFT), "resolve": _draft_tokens})
    # The drafts' vocabulary: None (all of it), N (the N lowest ids) or a token map file (ninfer.runtime.draft_vocab).
    draft_vocab: int | str | None = dataclasses.field(
        default=None, metadata={"options": (_DRAFT_VOCAB, _TOKEN_MAP), "resolve": _draft_vocab})
    pause_host_bytes: int = option(Option(
        "pause_host_gib", 4.0, "pinned host memory for snapshots of requests paused when the KV pool runs "
        "out; beyond it paused requests are recomputed", kind=float, check=at_least(0), to_field=gib_to_bytes,
        metavar="GIB"))
    host_prepin_bytes: int = option(Option(
        "host_prepin_gib", 0.0, "pin this much of the host memory above at start-up, so that the first host "
        "copies run at copy speed rather than at the ~1 GB/s of pinning fresh memory", kind=float,
        check=at_least(0), to_field=gib_to_bytes, metavar="GIB"))
    warmup: bool = option(Option(
        "warmup", True, "on CUDA, compile and autotune every prefill chunk length class at start-up", kind=bool,
        flag_help="skip the start-up compiling and autotuning on CUDA (the first requests then wait for it)"))

    @property
    def num_state_slots(self) -> int:
        per_lane = 1 + (self.draft_tokens + 1 if self.draft_tokens else 0)  # + per-token verify states
        return self.max_concurrency * per_lane + (self.checkpoint_slots if self.prefix_cache else 0)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, label: Callable[[Option], str] | None = None,
                     caller: str = "load()") -> EngineConfig:
        """The config of the user-facing ``options`` (``ninfer.load``'s keywords; every other one keeps its
        default). ``label`` names an option in errors (default: its keyword). Raises
        :class:`~ninfer.runtime.options.OptionError` (a ValueError) or TypeError."""
        return cls(**resolve(cls, options, label or (lambda opt: opt.name), caller))

    @classmethod
    def options(cls) -> list[Option]:
        """The user-facing options, in field order."""
        return options_of(cls)


__all__ = ["EngineConfig", "GIB", "MAX_DRAFT_TOKENS", "MAX_LANES", "Option"]
