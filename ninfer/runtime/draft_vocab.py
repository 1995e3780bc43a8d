"""The drafts' vocabulary: which token ids the MTP head may propose (``draft_vocab`` / ``draft_token_map``).

Each draft step ends in the LM head, and over the whole vocabulary (248,320 rows) that is most of a draft's bytes:
1.27 GB per draft for the 27B's int8 head, 0.51 GB for the 35B-A3B's. Drafting among a subset of frequent tokens
reads only their rows (FR-Spec, SGLang's ``--speculative-token-map``): the subset's rows are dequantized once, at
start-up, into a small bf16 matrix, and each draft is the argmax over it, mapped back to its token id.

Outputs do not change: verification keeps exactly the target's tokens, and a draft is a point mass whatever
vocabulary it came from. What changes is how many drafts are accepted: a token outside the subset is never
drafted, so a round that needed one stops there. The subset is either the ``N`` lowest ids (byte-level BPE
numbers its tokens in merge order, so these are the pairs its corpus merged first: a frequency proxy, not a
measurement) or a file of ids measured on the user's own traffic.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


class DraftVocabError(ValueError):
    """A draft token map that cannot be used; the message names the file."""


def read_token_map(path: str | Path) -> list[int]:
    """The token ids listed in ``path``: a ``torch.save``'d 1-D integer tensor or list (SGLang's format), a JSON
    list of ints, or ids separated by whitespace or commas."""
    path = Path(path)
    try:
        if path.suffix in (".pt", ".pth", ".bin"):
            ids = torch.load(path, map_location="cpu", weights_only=True)
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        elif path.suffix == ".json":
            ids = json.loads(path.read_text())
        else:
            ids = [int(word) for word in path.read_text().replace(",", " ").split()]
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as err:
        raise DraftVocabError(f"draft token map {path}: cannot read a list of token ids ({err})") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftVocabError(f"draft token map {path}: expected a non-empty list of integer token ids")
    return ids


def draft_token_ids(source: int | str | Path | None, vocab_limit: int,
                    device: torch.device | str) -> torch.Tensor | None:
    """The sorted, distinct ids drafts may take (``long`` on ``device``), or None for the whole vocabulary.

    ``source``: None; ``N`` (the ids ``0 .. N - 1``; all of them when ``N >= vocab_limit``); or a token map file
    (:func:`read_token_map`), whose ids must lie below ``vocab_limit`` (the tokenizer's vocabulary)."""
    if source is None:
        return None
    if isinstance(source, int):
        return None if source >= vocab_limit else torch.arange(source, device=device)
    ids = sorted(set(read_token_map(source)))
    if ids[0] < 0 or ids[-1] >= vocab_limit:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise DraftVocabError(f"draft token map {source}: token id {bad} is outside the vocabulary "
                              f"(0-{vocab_limit - 1})")
    if len(ids) == vocab_limit:
        return None
    return torch.tensor(ids, dtype=torch.long, device=device)
