"""Bad input to `repro checkpoint import-hf | export-hf` and `repro generate`: one line naming the
problem and the fix, exit 2, before any loading or sampling; and a padded GPT-2 vocabulary (50,304
ids) that exports GPT-2's end-of-text id and generates only ids the tokenizer has.

An unwritable --out is a path under /proc: nothing can be created there, for root too (CI runs as
root, where permission bits do not stop a write)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval_helpers import mirror
from test_import_hf import _hf_model

GPT2_EOT, PADDED_VOCAB, FAVOURITE = 50256, 50304, 100  # FAVOURITE: the most probable id below 50,257


def _cli(*args, cwd: Path, **env) -> subprocess.CompletedProcess:
    """`repro ARGS` in a fresh process run in `cwd` (outside the checkout: the package on the path is used)."""
    environ = {k: v for k, v in os.environ.items() if k not in env or env[k] is not None}
    environ.update({k: v for k, v in env.items() if v is not None}, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "repro.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=environ)


def _main(argv) -> int:
    from repro.cli import main

    return main([str(a) for a in argv])


def _user_error(proc: subprocess.CompletedProcess, *named: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(n in proc.stderr for n in named), proc.stderr[-3000:]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    _hf_model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def padded_gpt(tmp_path_factory):
    """A model-only checkpoint of a GPT with model.vocab_size=50304 whose most probable next token is
    always id 50300 (a row GPT-2 BPE lacks), then id FAVOURITE."""
    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT
    from repro.train.reshard import _write_imported

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=PADDED_VOCAB,
                      make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0)
    state = GPT(cfg, seed=1).state_dict()
    with torch.no_grad():
        state["transformer.ln_f.weight"].zero_()  # every final hidden state is ln_f.bias: ones
        state["transformer.ln_f.bias"].fill_(1.0)
        state["transformer.wte.weight"][50300] = 5.0  # logit 160
        state["transformer.wte.weight"][FAVOURITE] = 2.0  # logit 64; the others about 0.1
    path = tmp_path_factory.mktemp("padded") / "ck"
    _write_imported(state, cfg, path, 1, {"imported_from": "test"})
    return path


def test_the_package_under_test_is_the_one_on_the_path(tmp_path):
    import repro

    proc = subprocess.run([sys.executable, "-c", "import repro; print(repro.__file__)"], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.stdout.strip() == repro.__file__


# ---- an unwritable --out ---------------------------------------------------------------------------

def test_export_and_import_refuse_an_unwritable_out_before_loading(hf_dir, padded_gpt, tmp_path):
    out = Path("/proc") / f"repro-test-{os.getpid()}"
    proc = _cli("checkpoint", "export-hf", padded_gpt, "--out", out, cwd=tmp_path)
    _user_error(proc, f"--out {out}: /proc is not writable", "Fix")
    proc = _cli("checkpoint", "import-hf", hf_dir, "--out", out / "x", cwd=tmp_path)
    _user_error(proc, f"--out {out / 'x'}: /proc is not writable", "Fix")
    assert "Loading" not in proc.stderr + proc.stdout


def test_a_directory_that_cannot_be_created_is_a_checkpoint_error(monkeypatch):
    """Where the up-front check passes but creating the directory fails (a race, a quota)."""
    from repro.train import reshard as rs
    from repro.train.checkpoint import CheckpointError

    monkeypatch.setattr(rs, "unwritable_ancestor", lambda path: None)
    with pytest.raises(CheckpointError, match=r"cannot create .*Fix: give a writable path"):
        with rs.new_directory(Path("/proc") / f"repro-test-{os.getpid()}"):
            pass


def test_generate_refuses_an_unwritable_out_before_sampling(padded_gpt, capsys):
    out = Path("/proc") / f"repro-test-{os.getpid()}.json"
    code = _main(["generate", "--checkpoint", padded_gpt, "--max-new-tokens", "2", "--data-dir", mirror(),
                  "--out", out])
    printed = capsys.readouterr()
    assert code == 2 and f"--out {out}: /proc is not writable. Fix" in printed.err, printed.err
    assert "=== sample" not in printed.out


# ---- a padded GPT-2 vocabulary ---------------------------------------------------------------------

def test_export_of_a_padded_gpt2_vocabulary_names_gpt2s_end_of_text(padded_gpt, tmp_path):
    from repro.data.tokenizers import build_tokenizer

    assert _main(["checkpoint", "export-hf", padded_gpt, "--out", tmp_path / "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    eot = build_tokenizer("gpt2", mirror()).eod
    assert eot == GPT2_EOT and config["vocab_size"] == PADDED_VOCAB
    assert config["eos_token_id"] == config["bos_token_id"] == eot
    assert generation["eos_token_id"] == generation["bos_token_id"] == eot


def test_generate_draws_no_id_the_tokenizer_lacks(padded_gpt, tmp_path, capsys):
    out = tmp_path / "samples.json"
    assert _main(["generate", "--checkpoint", padded_gpt, "--greedy", "--max-new-tokens", "3", "--data-dir",
                  mirror(), "--out", out]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["samples"][0]["tokens"] == [FAVOURITE] * 3


# ---- import-hf sources -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_import_of_a_file_asks_for_the_directory(hf_dir, tmp_path, name):
    proc = _cli("checkpoint", "import-hf", hf_dir / name, "--out", tmp_path / "ck", cwd=tmp_path)
    _user_error(proc, f"{hf_dir / name} is a file: give the directory", "save_pretrained wrote (with config.json)")
    assert not (tmp_path / "ck").exists()


def test_unreadable_pytorch_weights_are_a_user_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_positions=16, n_embd=8, n_layer=1, n_head=2).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"not a pickle")
    proc = _cli("checkpoint", "import-hf", tmp_path / "hf", "--out", tmp_path / "ck", cwd=tmp_path)
    _user_error(proc, "cannot import", "weights file cannot be read")
    assert not (tmp_path / "ck").exists()


def test_a_directory_without_config_json_is_named(hf_dir, tmp_path):
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    proc = _cli("checkpoint", "import-hf", "weights_only", "--out", "ck", cwd=tmp_path)
    _user_error(proc, "weights_only holds no config.json")
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "ck").exists()


def test_a_mistyped_local_path_is_a_missing_directory_not_a_hub_name(tmp_path):
    (tmp_path / "runs").mkdir()
    proc = _cli("checkpoint", "import-hf", "runs/gpt2_typo", "--out", "ck", cwd=tmp_path,
                HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))  # offline: the old code fails fast too
    _user_error(proc, "runs/gpt2_typo: no such directory")


@pytest.mark.parametrize("env, reason", [
    ({"HF_HUB_OFFLINE": "1"}, "offline mode"),
    ({"HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"}, "127.0.0.1:9"),
])
def test_a_hub_name_neither_cached_nor_reachable_says_both(tmp_path, env, reason):
    proc = _cli("checkpoint", "import-hf", "no-such-org/no-such-gpt2", "--out", "ck", cwd=tmp_path,
                HF_HOME=str(tmp_path / "hf_home"), **env)
    _user_error(proc, "no local directory no-such-org/no-such-gpt2, and the Hugging Face hub could not be "
                      "reached", reason)
    assert "Retry" not in proc.stderr


def test_a_hub_name_in_the_local_cache_imports_without_the_hub(hf_dir, tmp_path):
    from repro.train.checkpoint import read_meta

    commit = "0" * 40
    repo = tmp_path / "hf_home" / "hub" / "models--test-org--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (repo / "snapshots" / commit / name).write_bytes((hf_dir / name).read_bytes())
    proc = _cli("checkpoint", "import-hf", "test-org/tiny-gpt2", "--out", "ck", cwd=tmp_path,
                HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE=None, TRANSFORMERS_OFFLINE=None,
                HF_ENDPOINT="http://127.0.0.1:9")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_meta(tmp_path / "ck")["imported_from"] == "test-org/tiny-gpt2" and "Retry" not in proc.stderr
