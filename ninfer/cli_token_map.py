"""``ninfer token-map``: the most frequent tokens of your own text, as a draft token map (``--draft-token-map``).

Drafting among a subset of the vocabulary makes each draft's LM head cheaper (docs/speculative.md, "Draft
vocabulary"); how many drafts are still accepted depends on how much of the model's output the subset covers.
This command counts the tokens of text files with the checkpoint's tokenizer (prompts and replies like those the
server will see), keeps the ``--top`` most frequent and the ids that end a turn, writes them in a format
``--draft-token-map`` reads (SGLang's ``.pt``, JSON or text), and prints the share of the counted tokens the map
covers: an upper bound on the share of drafts it can still propose.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from ninfer.cli_options import CliError, HelpFormatter, add_model_argument, positive

EXAMPLES = """examples:
  ninfer token-map ./Qwen3.6-27B --text chats/*.txt --top 32768 --out hot.pt
  ninfer serve ./Qwen3.6-27B --spec mtp --draft-token-map hot.pt
"""


def add_token_map_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("token-map", help="count the tokens of text files into a draft token map",
                       description="Tokenize UTF-8 text files with the checkpoint's tokenizer, keep the most "
                                   "frequent token ids (and those that end a turn) and write them for "
                                   "--draft-token-map; prints how much of the counted text the map covers.",
                       epilog=EXAMPLES, formatter_class=HelpFormatter)
    add_model_argument(p)
    p.add_argument("--text", type=Path, nargs="+", required=True, metavar="FILE",
                   help="UTF-8 text to count (prompts and replies like the traffic the map is for)")
    p.add_argument("--top", type=positive("--top"), default=32768, metavar="N",
                   help="keep the N most frequent ids (default 32768)")
    p.add_argument("--out", type=Path, required=True, metavar="FILE",
                   help="where to write the map: .pt (a torch.save'd tensor, SGLang's format), .json or text")
    p.set_defaults(func=run_token_map)
    return p


def count_tokens(tokenizer, paths: list[Path]) -> Counter[int]:  # noqa: ANN001  (ninfer.tokenizer.Tokenizer)
    counts: Counter[int] = Counter()
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CliError(f"--text: file {path} not found") from None
        except UnicodeDecodeError as err:
            raise CliError(f"--text: {path} is not UTF-8 ({err})") from None
        counts.update(tokenizer.encode(text))
    if not counts:
        raise CliError("--text: the files hold no tokens")
    return counts


def token_map(counts: Counter[int], top: int, always: set[int]) -> list[int]:
    """The ``top`` most frequent ids (ties: the lower id first), then ``always`` (turn ends) where missing."""
    ranked = sorted(counts, key=lambda tid: (-counts[tid], tid))[:top]
    return ranked + sorted(always - set(ranked))


def write_token_map(ids: list[int], out: Path) -> None:
    if out.suffix in (".pt", ".pth"):
        import torch

        torch.save(torch.tensor(ids, dtype=torch.long), out)
    elif out.suffix == ".json":
        out.write_text(json.dumps(ids))
    else:
        out.write_text("\n".join(map(str, ids)) + "\n")


def run_token_map(args: argparse.Namespace) -> None:
    from ninfer.checkpoint import resolve_model_path
    from ninfer.default_model import default_model_path
    from ninfer.tokenizer import Tokenizer, stop_token_ids

    model_dir = resolve_model_path(args.model) if args.model else default_model_path()
    tokenizer = Tokenizer(model_dir)
    counts = count_tokens(tokenizer, args.text)
    ids = token_map(counts, args.top, stop_token_ids(model_dir, tokenizer, ()))
    write_token_map(ids, args.out)
    covered = sum(counts[tid] for tid in ids) / sum(counts.values())
    print(f"wrote {args.out}: {len(ids)} token ids; they cover {covered:.1%} of the {sum(counts.values())} tokens "
          f"counted ({len(counts)} distinct)", file=sys.stderr)
