"""Structured output: constraints compiled by xgrammar into grammars, per-request matchers, logit masks.

A :class:`Constraint` says what the answer must be (a JSON object, a JSON Schema, a regex, one of
some strings, an EBNF grammar, or a tool call in the model's XML format). :class:`StructuredCompiler`
turns it into an xgrammar ``CompiledGrammar`` (xgrammar caches compiled grammars by their text) and
a :class:`GrammarState` for one request; compile before handing the request to the engine, so the
engine thread never compiles. Only when a request of the batch is constrained, the sampler calls
:func:`fill_bitmask`: it fills the constrained rows' token bitmasks into a pinned host buffer, copies
them to the device, and the fused sampling kernel treats each disallowed logit as ``-inf`` before
penalties, temperature and the filters (and the logprobs, which are the constrained distribution's). The output processor
advances the state with each committed token; stop tokens are allowed only where the grammar
accepts, so a constrained answer ends exactly when the grammar does (or at ``max_tokens``).

Thinking: with a reasoning request the state stays inactive (no mask) until the model writes
``</think>``; the constraint applies from the answer's first token. Speculative decoding: the K+1
verification rows are masked along the draft (the matcher accepts the drafts tentatively and rolls
back), so a draft the grammar forbids is never accepted. xgrammar is optional: without it a
constraint raises :class:`StructuredUnavailable`.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ninfer.kernels.sampling import apply_bitmask
from ninfer.runtime.structured_schema import check_schema

INSTALL_HINT = "structured output needs `pip install ninfer[structured]` (the xgrammar package)"
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call")
COMPILER_CACHE_BYTES = 256 << 20
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'  # as xgrammar prints it: no quote, backslash, CR or LF
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'  # and no other control character either
_OPTIONAL_BLANK = r'("" | ([ \n\r\t]))'
_OPTIONAL_NEWLINE = r'("" | ("\n"))'


class StructuredError(ValueError):
    """A constraint that cannot be compiled; ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class StructuredUnavailable(StructuredError):
    """xgrammar is not installed."""


@dataclass(frozen=True)
class Constraint:
    """What a request's answer must match. ``text``: the JSON Schema (JSON text), regex or EBNF;
    ``choices``: the allowed strings; ``param``: the field it came from, named in errors."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()
    param: str = "structured"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice" and not self.choices:
            raise StructuredError(f"'{self.param}' needs at least one choice", self.param)
        if self.kind in ("regex", "grammar") and not self.text:
            raise StructuredError(f"'{self.param}' is empty", self.param)

    @classmethod
    def json_object(cls, param: str = "structured") -> Constraint:
        """Any JSON object."""
        return cls("json_object", param=param)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | type, param: str = "structured") -> Constraint:
        """JSON matching ``schema`` (a dict, JSON text, or a Pydantic model class)."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise StructuredError(f"'{param}' is not valid JSON: {err}", param) from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredError(f"'{param}' must be a JSON Schema object", param)
        check_schema(schema, param)
        return cls("json_schema", json.dumps(schema), param=param)

    @classmethod
    def regex(cls, pattern: str, param: str = "structured") -> Constraint:
        """Text matching the regular expression ``pattern`` as a whole."""
        return cls("regex", pattern, param=param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str = "structured") -> Constraint:
        """Exactly one of ``choices``."""
        if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
            raise StructuredError(f"'{param}' must be a list of strings", param)
        return cls("choice", choices=tuple(choices), param=param)

    @classmethod
    def grammar(cls, ebnf: str, param: str = "structured") -> Constraint:
        """Text of the EBNF (GBNF-style, root rule ``root``) grammar ``ebnf``."""
        return cls("grammar", ebnf, param=param)

    @classmethod
    def tool_call(cls, tools: list[dict[str, Any]], name: str | None = None, parallel: bool = True,
                  param: str = "tool_choice") -> Constraint:
        """Tool calls in the model's Qwen3-Coder XML format whose parameters satisfy each function's JSON
        Schema: at least one call of any of ``tools`` (OpenAI chat-format definitions), or, with ``name``,
        one call of that function. ``parallel``: further calls may follow the first."""
        names = [t["function"]["name"] for t in tools]
        if name is not None and name not in names:
            raise StructuredError(f"'{param}' names the function {name!r}, which is not among the tools", param)
        for i, t in enumerate(tools):
            check_schema(t["function"].get("parameters") or {}, f"tools[{i}].function.parameters")
        text = json.dumps({"tools": tools, "name": name, "parallel": parallel and name is None})
        return cls("tool_call", text, param=param)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise StructuredUnavailable(INSTALL_HINT, "structured") from None
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes are EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredCompiler:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe (xgrammar's compiler is)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], think_end_id: int | None,
                 threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.think_end_id = think_end_id
        self._hf, self._stop_ids, self._threads = hf_tokenizer, sorted(stop_ids), threads
        self._compiler: Any = None
        self._lock = threading.Lock()  # two first requests at once load the vocabulary once

    @property
    def compiler(self) -> Any:
        """xgrammar's ``GrammarCompiler``, made on first use (loading the vocabulary takes a moment)."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads,
                                                     cache_limit_bytes=COMPILER_CACHE_BYTES)
            return self._compiler

    def compile(self, c: Constraint) -> Any:
        """The ``CompiledGrammar`` of ``c``; an invalid or impossible constraint raises StructuredError."""
        compiler = self.compiler
        try:
            if c.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if c.kind == "json_schema":
                return self._compile_schema(c.text)
            if c.kind == "regex":
                return compiler.compile_regex(c.text)
            if c.kind == "choice":
                return compiler.compile_grammar(choice_grammar(c.choices))
            if c.kind == "tool_call":
                return self._compile_tool_call(c.text)
            return compiler.compile_grammar(c.text)
        except (RuntimeError, ValueError, TypeError) as err:
            what = {"json_object": "JSON object", "json_schema": "JSON Schema", "regex": "regular expression",
                    "choice": "choice list", "grammar": "grammar", "tool_call": "tool-call format"}[c.kind]
            raise StructuredError(f"'{c.param}': the {what} cannot be compiled: {_short(err)}", c.param) from None

    def _compile_schema(self, schema: str) -> Any:
        """Compact separators and no free whitespace (a model cannot stall in endless blanks); strings
        with length bounds get JSON's character class: xgrammar 0.2.8 lets them hold raw control
        characters, which no JSON parser accepts."""
        xgr = _xgrammar()
        ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
        fixed = ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)
        if fixed == ebnf:
            return self.compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        return self.compiler.compile_grammar(fixed)

    def _compile_tool_call(self, text: str) -> Any:
        """xgrammar's Qwen3.5 tool-call format, its optional blanks (around values, between parameters,
        inside JSON values) narrowed to one newline: the template's framing, which the tool-call parser
        strips. A space or tab there would end up inside a string argument (or break an enum)."""
        xgr = _xgrammar()
        ebnf = str(xgr.Grammar.from_structural_tag(_tool_call_tag(text)))
        return self.compiler.compile_grammar(ebnf.replace(_OPTIONAL_BLANK, _OPTIONAL_NEWLINE))

    def state(self, c: Constraint, thinking: bool = False) -> GrammarState:
        """A fresh matcher for one request; with ``thinking`` the constraint starts after ``</think>``."""
        xgr = _xgrammar()
        matcher = xgr.GrammarMatcher(self.compile(c))
        return GrammarState(matcher, self.think_end_id if thinking else None)


def _tool_call_tag(text: str) -> Any:
    """xgrammar's structural tag of Qwen3.5's tool calls (reasoning is handled by :class:`GrammarState`)."""
    spec = json.loads(text)
    name = spec["name"]
    choice = {"type": "function", "function": {"name": name}} if name is not None else "required"
    return _xgrammar().get_builtin_structural_tag("qwen_3_5", tools=spec["tools"], tool_choice=choice,
                                                  reasoning="disabled", parallel_tool_calls=spec["parallel"],
                                                  max_whitespace_cnt=1)  # one optional blank, as a rule


def _short(err: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(err).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text.splitlines()[0][:300] if text else type(err).__name__


class GrammarState:
    """One request's position in its grammar; inactive (no mask) until ``think_end`` when thinking.

    Committed tokens are queued by :meth:`accept` and applied when the next mask is filled: xgrammar's
    ``accept_token`` takes 60-100 µs at a 248k vocabulary, and between reading a step's tokens and launching the
    next forward it would hold up the GPU for each constrained lane; the fill runs while that forward does."""

    def __init__(self, matcher: Any, think_end: int | None = None) -> None:
        self.matcher = matcher
        self.think_end = think_end
        self._active = think_end is None
        self._pending: list[int] = []
        self._failed: str | None = None

    @property
    def active(self) -> bool:
        """Whether the constraint applies (after ``think_end`` when thinking), given every accepted token."""
        self._catch_up()
        return self._active

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        """Advance by a committed token (the mask made sure the grammar allows it), at the next fill."""
        self._pending.append(token)

    def _catch_up(self) -> None:
        if self._failed is not None:  # every later fill fails too: the matcher no longer follows the output
            raise RuntimeError(self._failed)
        pending, self._pending = self._pending, []
        for token in pending:
            if not self._active:
                self._active = token == self.think_end
                continue
            if self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                self._failed = f"token {token} was sampled but the grammar does not allow it"
                raise RuntimeError(self._failed)

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int] = ()) -> list[bool]:
        """Fill ``bitmask`` rows ``first_row ..`` for the token after each prefix ``drafts[:j]`` of the
        draft (``j = 0 .. len(drafts)``); returns which rows are constrained. The matcher accepts the
        drafts tentatively and rolls back, so the state afterwards is as before. A row after a draft
        the grammar forbids stays unconstrained: verification can never commit it."""
        self._catch_up()
        flags: list[bool] = []
        was_active, accepted = self._active, 0
        for j in range(len(drafts) + 1):
            on = self._active and not self.matcher.is_terminated()
            if on:
                self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
            flags.append(on)
            if j == len(drafts):
                break
            token = drafts[j]
            if not self._active:
                self._active = token == self.think_end
                continue
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                flags.extend([False] * (len(drafts) - j))
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        self._active = was_active
        return flags


def fill_bitmask(bitmask: torch.Tensor, mask_rows: torch.Tensor, reqs: Sequence[Any], rows_per_req: int = 1,
                 drafts: torch.Tensor | None = None) -> int:
    """Fill the token bitmasks of the constrained requests' rows into ``bitmask`` (host, int32 ``[R, words]``)
    and ``mask_rows [len(reqs) * rows_per_req]`` (host int32: each row's bitmask row, -1 unconstrained), for
    the fused sampler (``sample(..., bitmask=, mask_rows=)``). Row ``b * rows_per_req + j`` belongs to
    ``reqs[b]``; with ``drafts [b, rows_per_req - 1]`` row ``j`` is the token after the first ``j`` drafts.
    Constrained requests take consecutive bitmask rows from 0, so only rows ``[0, n)`` need copying to the
    device; returns that ``n`` (0: nothing constrained). Requests whose ``grammar`` is None cost nothing."""
    mask_rows.fill_(-1)
    draft_lists = drafts.tolist() if drafts is not None and rows_per_req > 1 else None
    used = 0
    for b, req in enumerate(reqs):
        state = getattr(req, "grammar", None)
        if state is None:
            continue
        flags = state.fill_rows(bitmask, used, draft_lists[b] if draft_lists else ())
        for j, on in enumerate(flags):
            if on:
                mask_rows[b * rows_per_req + j] = used + j
        if any(flags):
            used += rows_per_req
    return used


def mask_logits(logits: torch.Tensor, reqs: Sequence[Any], rows_per_req: int = 1,
                drafts: torch.Tensor | None = None) -> None:
    """Set the logits of tokens each constrained request's grammar forbids to ``-inf``, in place, with torch
    ops (the sampler passes the bitmask to the fused kernel instead; this is the same mask, for callers
    that need masked logits). Rows as in :func:`fill_bitmask`."""
    n_rows, vocab = logits.shape
    bitmask = torch.full((n_rows, -(-vocab // 32)), -1, dtype=torch.int32)
    mask_rows = torch.empty(n_rows, dtype=torch.int32)
    if fill_bitmask(bitmask, mask_rows, reqs, rows_per_req, drafts):
        # packed: 1/32 of the vocabulary's bytes cross to the device
        logits.copy_(apply_bitmask(logits, bitmask.to(logits.device), mask_rows.to(logits.device)))
