"""Export a snapshot as a Hugging Face GPT-2 checkpoint that transformers loads.

    mingpt-export runs/default out/my-gpt2                    # a run (or a store): its newest good snapshot
    mingpt-export s3://bucket/run1/step_000002000 out/my-gpt2 --endpoint-url http://minio:9000

Writes config.json and model.safetensors (GPT2LMHeadModel.from_pretrained(OUT) loads them) and,
for a run with GPT-2's BPE, the tokenizer files (vocab.json, merges.txt, ...), so that
AutoTokenizer.from_pretrained(OUT) works too. transformers has no tokenizer for a character-level
run: its vocabulary is written to mingpt_tokenizer.json, for your own code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mingpt.cli.snapshot import store_path
from mingpt.model.pretrained import write_gpt2
from mingpt.model.tokenizer import EOT, TokenizerError, from_state
from mingpt.runtime.console import quiet_on_closed_pipe
from mingpt.runtime.exits import Exit
from mingpt.snapshot.restore import load_from
from mingpt.snapshot.store import SnapshotError


def export(source: str, out: Path, storage_options: dict | None = None, ranks_file: str | None = None) -> str:
    """Write the checkpoint; returns what a person should know about it (one line)."""
    state, manifest = load_from(store_path(source), storage_options)
    shape, tok_state = manifest["model_shape"], manifest["tokenizer"]
    if tok_state["kind"] == "bpe":
        tokenizer = from_state(tok_state, ranks_file)
        ids = {"bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id}
        write_gpt2(out, state["model"], shape, ids)
        vocab, merges = tokenizer.vocab_and_merges()
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", "model_max_length": shape["block_size"], "add_prefix_space": False,
             **special}, indent=2) + "\n")
        note = "GPT-2 BPE tokenizer files written"
    else:
        write_gpt2(out, state["model"], shape)
        (out / "mingpt_tokenizer.json").write_text(json.dumps(tok_state, indent=1) + "\n")
        note = ("a character-level run: transformers has no tokenizer for it; its vocabulary is in "
                "mingpt_tokenizer.json (token i is the i-th character)")
    return (f"exported step {manifest['step']} ({shape['n_layer']} layers, {shape['n_head']} heads, {shape['n_embd']} "
            f"wide, context {shape['block_size']}, vocabulary {shape['vocab_size']}) to {out}; {note}")


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mingpt-export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshot", help="a snapshot folder, or a run directory or a store (its newest good snapshot); "
                    "local or s3://")
    ap.add_argument("out", help="the directory to write (created if missing)")
    ap.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    ap.add_argument("--ranks-file", default=None, help="local GPT-2 ranks file, for BPE runs without internet")
    args = ap.parse_args(argv)
    try:
        print(export(args.snapshot, Path(args.out), {"endpoint_url": args.endpoint_url} if args.endpoint_url else None,
                     args.ranks_file))
    except (SnapshotError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
