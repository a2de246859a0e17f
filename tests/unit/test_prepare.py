"""mingpt-prepare's command line (mingpt/cli/prepare.py): its summary, its refusals, verify."""

import json
import subprocess
import sys

from conftest import SMALL, gpt2_ranks, texts

from mingpt.data.prepare import prepare


def test_the_command_prints_its_summary_once_and_refuses_a_ranks_file_for_char(tmp_path):
    (tmp_path / "a.txt").write_text("\n".join(texts(50)) + "\n")
    cmd = [sys.executable, "-m", "mingpt.cli.prepare", str(tmp_path / "a.txt"), "--workers", "1"]
    done = subprocess.run([*cmd, "--out", str(tmp_path / "ds"), "--tokenizer.ranks_file", gpt2_ranks()], capture_output=True,
                          text=True, timeout=120)
    tokens = json.loads((tmp_path / "ds" / "manifest.json").read_text())["tokens"]
    assert done.returncode == 0 and (done.stdout + done.stderr).count(f"{tokens:,} tokens") == 1, done
    char = subprocess.run([*cmd, "--out", str(tmp_path / "c"), "--tokenizer.kind", "char", "--tokenizer.ranks_file",
                           gpt2_ranks()], capture_output=True, text=True, timeout=120)
    assert char.returncode == 2 and char.stderr.startswith("error: --tokenizer.ranks_file applies to "
                                                           "--tokenizer.kind=bpe only"), char
    assert len(char.stderr.splitlines()) == 1 and not (tmp_path / "c").exists()


def test_verify_names_a_damaged_local_shard(inputs, tmp_path, capsys):
    from mingpt.cli.prepare import main

    m = prepare([str(inputs / "b.jsonl")], str(tmp_path / "ds"), SMALL, ranks_file=gpt2_ranks(), workers=1)
    assert main(["--verify", str(tmp_path / "ds")]) == 0
    assert "every shard and the index match the manifest" in capsys.readouterr().out
    victim = tmp_path / "ds" / m["shards"][2]["name"]
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))
    assert main(["--verify", str(tmp_path / "ds")]) == 1
    err = capsys.readouterr().err
    assert f"damaged: {m['shards'][2]['name']} fails its checksum" in err and err.count("damaged:") == 1
