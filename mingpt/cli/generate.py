"""Sample text from a snapshot.

    mingpt-generate runs/default --prompt "ROMEO:" --max-new-tokens 300
    mingpt-generate runs/default/snapshots/step_000002000 --temperature 0.8 --top-k 40

The path is a run directory or a snapshot store (the newest good snapshot is used), or one
snapshot folder.
"""

from __future__ import annotations

import argparse
import codecs
import sys

import torch

from mingpt.cli.snapshot import store_path
from mingpt.model.generate import stream
from mingpt.model.gpt import GPT, GPTConfig
from mingpt.model.tokenizer import TokenizerError, from_state
from mingpt.runtime.console import quiet_on_closed_pipe
from mingpt.runtime.exits import Exit
from mingpt.snapshot.restore import load_from
from mingpt.snapshot.store import SnapshotError


def load_model(path: str, storage_options: dict | None = None) -> tuple[GPT, dict]:
    """The raw GPT of a snapshot (or of a run's or a store's newest good snapshot) and its manifest."""
    state, manifest = load_from(store_path(path), storage_options)
    shape = manifest["model_shape"]
    cfg = GPTConfig(preset=None, n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                    block_size=shape["block_size"], vocab_size=shape["vocab_size"], bias=shape["bias"])
    model = GPT(cfg)
    model.load_state_dict(state["model"])
    return model.eval(), manifest


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mingpt-generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshot", help="run directory, snapshot store or snapshot folder (local path or s3://)")
    ap.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    ap.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of tokens whose "
                    "probability reaches p")
    ap.add_argument("--stop-at-eot", action="store_true", help="stop a sample at the end-of-text token")
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole context at every token")
    ap.add_argument("--ranks-file", default=None, help="local GPT-2 ranks file, for BPE runs without internet")
    ap.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint, for s3:// snapshots")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (default: 1 for a model under 50M "
                    "parameters, whose small matrices gain nothing from more and lose much beside a training run; "
                    "else every core)")
    return ap


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        model, manifest = load_model(args.snapshot, {"endpoint_url": args.endpoint_url} if args.endpoint_url else None)
        tok = from_state(manifest["tokenizer"], args.ranks_file)
        ids = tok.encode(args.prompt)
    except (SnapshotError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.BAD_INPUT
    if not ids:
        print("error: the prompt encodes to no tokens; give a non-empty --prompt", file=sys.stderr)
        return Exit.BAD_INPUT
    if args.stop_at_eot and tok.eot_id is None:
        print("error: this run's tokenizer has no end-of-text token; leave out --stop-at-eot", file=sys.stderr)
        return Exit.BAD_INPUT
    threads = args.threads or (1 if model.num_params() < 50e6 else torch.get_num_threads())
    torch.set_num_threads(threads)
    print(f"mingpt-generate: sampling from the snapshot of step {manifest['step']} in {store_path(args.snapshot)} "
          f"(run {manifest.get('run_id', '?')}, {model.num_params() / 1e6:.2f}M parameters, {args.device}"
          f"{f', {threads} thread' + ('s' if threads > 1 else '') if args.device == 'cpu' else ''})", file=sys.stderr)
    model.to(args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    for i in range(args.num_samples):
        if i:
            print("\n" + "-" * 40)
        # Tokens are printed as they come; a character split over tokens waits for its last byte.
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(args.prompt)
        idx = torch.tensor([ids], dtype=torch.long, device=args.device)
        for nxt in stream(model, idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                          tok.eot_id if args.stop_at_eot else None, gen, use_cache=not args.no_cache):
            token = int(nxt[0, 0])
            if args.stop_at_eot and token == tok.eot_id:
                break
            sys.stdout.write(text.decode(tok.token_bytes(token)))
            sys.stdout.flush()
        sys.stdout.write(text.decode(b"", final=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
