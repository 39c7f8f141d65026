"""How a new engine's planner starts. Its memory (Planner.memory / recall, calibrate.save_memory /
load_memory, Engine): what an engine learned is kept beside the calibration cache and a new engine on the
same models starts from it; a bad file or entry is reported and left unused, never trusted;
PROVE_LOCAL_MEMORY=0 turns it off. Its first plans, made at prepare (Planner.warm)."""
import json
import math

import pytest

from prove_local import calibrate
from prove_local.engine import Engine, Settings
from prove_local.llama import Model
from prove_local.modes import LOOKUP
from prove_local.planner import MEMORY_SWITCH_WEIGHT, MEMORY_VERSION, SWITCH_AFTER, Planner
from tests.reference import greedy_ar
from tests.tiny import tiny_gguf

F32 = dict(n_ctx=512, n_threads=1, type_k="f32", type_v="f32")
PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat", "Natalia sold clips to 48 of her friends.",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PROVE_LOCAL_MEMORY", raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def prop(tmp_path_factory):
    m = Model(tiny_gguf(tmp_path_factory.mktemp("memory-models"), seed=0))
    yield m
    m.close()


def taught() -> Planner:
    """A planner with a record: MARS slots of two mode keys, lookup drafts, host times, switch records."""
    pl = Planner()
    pl.stats_for("lossless").record([0.9, 0.8, 0.7, 0.2], 1, 4, 2)
    pl.stats_for("prove@0.1").record([0.6, 0.5], 0, 2, 1)
    pl.stats_for(LOOKUP).record([0.5, 0.5, 0.5], 0, 3, 3)
    pl.overhead.update({"ar": 1e-4, ("lossless", 4): 3e-4})
    pl._after_wide = [[4e-4, 40], [6e-4, 3], [5e-4, 3], [0.0, 0], [0.0, 0]]
    pl._after_start = [[0.0, 0], [9e-4, 12], [7e-4, 12], [5e-4, 12], [4e-4, 12]]
    return pl


def test_a_memory_read_back_gives_a_new_planner_the_models_record_not_the_texts():
    mem = json.loads(json.dumps(taught().memory()))          # (through JSON, as on disk)
    pl = Planner()
    assert pl.recall(mem) is None
    for key in ("lossless", "prove@0.1"):
        assert pl.stats[key].counts() == taught().stats[key].counts()
    assert LOOKUP not in pl.stats                            # the lookup record is the text's: not kept
    assert LOOKUP not in mem["stats"]
    assert pl.overhead == {"ar": 1e-4, ("lossless", 4): 3e-4}
    # the switch records keep their means; their counts are capped, so this process's passes take over soon
    assert [m for m, _ in pl._after_wide] == [m for m, _ in taught()._after_wide]
    assert [n for _, n in pl._after_wide] == [min(n, MEMORY_SWITCH_WEIGHT) for _, n in taught()._after_wide]
    assert pl.switch_cost() == pytest.approx(taught().switch_cost())
    # what a planner learns after recalling goes on from there
    pl.stats_for("lossless").record([0.9, 0.9], 1, 2, 2)
    assert pl.stats["lossless"].n_cycles == taught().stats["lossless"].n_cycles + 1


@pytest.mark.parametrize("spoil, why", [
    (lambda m: m.update(version=MEMORY_VERSION + 1), "version"),
    (lambda m: m["stats"]["lossless"]["accepted"].__setitem__(1, 99.0), "stats['lossless']"),
    (lambda m: m["stats"]["lossless"]["tested"].__setitem__(0, math.nan), "stats['lossless']"),
    (lambda m: m["stats"]["lossless"].pop("bin_tested"), "stats['lossless']"),
    (lambda m: m["overhead"].append([["ar"], 1.0]), "overhead entry"),
    (lambda m: m["overhead"].append(["ar", -1.0]), "overhead entry"),
    (lambda m: m.update(after_wide=[[1.0, 2]] * (SWITCH_AFTER + 2)), "switch records"),
    (lambda m: m.update(stats=[]), "stats"),
])
def test_a_spoiled_memory_is_refused_whole_and_says_why(spoil, why):
    mem = taught().memory()
    spoil(mem)
    pl = Planner()
    before = json.dumps(pl.memory())
    reason = pl.recall(mem)
    assert reason is not None and why in reason
    assert json.dumps(pl.memory()) == before                  # nothing taken


def test_with_memory_lookup_the_lookup_record_is_written_and_read(monkeypatch):
    """planner.MEMORY_LOOKUP on (`scripts/issue_command.py --arms`, `dev/planner_ab.py`'s `memory-lookup`):
    the lookup drafts' record is written and read back, forgetting as fast as before; off (the default),
    a memory that has it is read without it."""
    import prove_local.planner as P
    monkeypatch.setattr(P, "MEMORY_LOOKUP", True)
    with_lookup = json.loads(json.dumps(taught().memory()))
    pl = Planner()
    assert pl.recall(with_lookup) is None
    assert pl.stats[LOOKUP].counts() == taught().stats[LOOKUP].counts()
    assert pl.stats[LOOKUP].decay == taught().stats[LOOKUP].decay       # (the lookup record forgets faster)
    monkeypatch.setattr(P, "MEMORY_LOOKUP", False)
    pl = Planner()
    assert pl.recall(with_lookup) is None
    assert LOOKUP not in pl.stats and pl.stats["lossless"].counts() == taught().stats["lossless"].counts()


def test_an_engine_starts_from_what_the_last_one_on_these_models_learned(prop, cache_dir):
    """A lossless auto engine writes its planner's memory when a request ends (the first one at once) and
    when closed; a new engine on the same model and options reads it at its calibration, and still
    decodes exactly what greedy ar does."""
    s = Settings(mode="lossless", block="auto", max_new=32)
    with Engine.load(prop, **F32) as first:
        # (exploring every cycle: the tiny model's MARS slots get a record)
        first.planner = Planner(explore=1.0, explore_wide=1.0, seed=1, explore_by_rate=False, explore_budget=float("inf"))
        for p in PROMPTS:
            list(first.generate(prop.tokenize(p), s))
        learned = first.planner.memory()
        assert calibrate.memory_path().is_file()              # (written at the end of the first request)
    assert learned["stats"]["lossless"]["n_cycles"] > 0
    data = json.loads(calibrate.memory_path().read_text())
    (key, entry), = data["entries"].items()
    assert key.startswith(calibrate.model_key(prop)) and "|memory|solo" in key
    assert entry["stats"] == json.loads(json.dumps(learned["stats"]))   # the closing write: all of it
    with Engine.load(prop, **F32) as second:
        second.prepare(s)
        assert second.planner.stats["lossless"].counts() == first.planner.stats["lossless"].counts()
        assert second.planner.overhead == first.planner.overhead
        assert second.planner.summary()["memory_from"] == entry["when"]     # (bench's results.json says so)
        for p in PROMPTS:
            out = [t for c in second.generate(prop.tokenize(p), s) for t in c.committed]
            assert out == greedy_ar(prop, prop.tokenize(p), 32, **F32)
    assert first.planner.summary()["memory_from"] is None


def test_memory_off_reads_and_writes_nothing(prop, cache_dir, monkeypatch):
    monkeypatch.setenv("PROVE_LOCAL_MEMORY", "0")
    with Engine.load(prop, **F32) as engine:
        list(engine.generate(prop.tokenize(PROMPTS[0]), Settings(mode="lossless", block="auto", max_new=16)))
    assert (cache_dir / "calibration.json").is_file() and not calibrate.memory_path().exists()


def test_an_unreadable_memory_file_is_named_and_replaced_not_fatal(prop, cache_dir, capsys):
    cache_dir.mkdir(parents=True, exist_ok=True)
    calibrate.memory_path().write_text('{"entries": {"x": ')        # (a write cut short)
    s = Settings(mode="lossless", block="auto", max_new=16)
    with Engine.load(prop, **F32) as engine:
        out = [t for c in engine.generate(prop.tokenize(PROMPTS[1]), s) for t in c.committed]
    assert out == greedy_ar(prop, prop.tokenize(PROMPTS[1]), 16, **F32)
    err = capsys.readouterr().err
    assert str(calibrate.memory_path()) in err and "could not be read" in err
    assert len(json.loads(calibrate.memory_path().read_text())["entries"]) == 1     # written anew


def test_a_spoiled_entry_is_reported_with_the_file_and_left_unused(prop, cache_dir, capsys):
    with Engine.load(prop, **F32) as engine:
        list(engine.generate(prop.tokenize(PROMPTS[0]), Settings(mode="lossless", block="auto", max_new=16)))
        key = engine.memory_key()
    data = json.loads(calibrate.memory_path().read_text())
    data["entries"][key]["overhead"] = "fast"
    calibrate.memory_path().write_text(json.dumps(data))
    with Engine.load(prop, **F32) as engine:
        engine.prepare(Settings(mode="lossless", block="auto"))
        assert engine.planner.overhead == {}
    err = capsys.readouterr().err
    assert "planner memory" in err and str(calibrate.memory_path()) in err and "overhead" in err


def test_entries_of_model_files_that_are_gone_are_dropped(prop, tmp_path, cache_dir):
    gone = tmp_path / "gone.gguf"
    gone.write_bytes(b"GGUF")
    calibrate.save_memory(calibrate.model_key(type("M", (), {"path": gone})()) + "|memory|solo", taught().memory())
    gone.unlink()
    with Engine.load(prop, **F32) as engine:
        list(engine.generate(prop.tokenize(PROMPTS[0]), Settings(mode="lossless", block="auto", max_new=8)))
        key = engine.memory_key()
    assert list(json.loads(calibrate.memory_path().read_text())["entries"]) == [key]


def test_a_batched_pools_engines_keep_a_memory_of_their_own_kind(prop, cache_dir):
    """Engines on a batched pool's shared contexts price passes beside other requests': their memory is
    kept apart from a solo engine's ("pool" in the key), and each of the pool's engines starts from it."""
    from prove_local.loading import Loaded
    from prove_local.pool import EnginePool

    import contextlib

    s = Settings(mode="lossless", block="auto", max_new=16)
    # (the requests' blocks fixed, on calibrated engines: every cycle a MARS one, so host times are recorded whatever the
    # planner would have chosen; planned, a cold planner on a slow host may keep to ar cycles, of
    # which only 1 in AR_SAMPLE is recorded, and 2 x 16 tokens can leave it with none)
    fixed = Settings(mode="lossless", block=4, max_new=16)
    with EnginePool(Loaded(prop, None, None, dict(F32)), parallel=2) as pool:
        for p in PROMPTS[:2]:
            with pool.engine() as (_, engine):
                engine.prepare(s)                 # (calibrated, as a planned request's engine is)
                out = [t for c in engine.generate(prop.tokenize(p), fixed) for t in c.committed]
            assert out == greedy_ar(prop, prop.tokenize(p), 16, **F32)
    (key, entry), = json.loads(calibrate.memory_path().read_text())["entries"].items()
    assert "|memory|pool" in key
    saved = Planner()
    assert saved.recall(entry) is None and saved.overhead
    with EnginePool(Loaded(prop, None, None, dict(F32)), parallel=2) as pool, contextlib.ExitStack() as held:
        first = held.enter_context(pool.engine())[1]
        first.prepare(s)                          # (calibrates: reads the memory)
        second = held.enter_context(pool.engine())[1]
        assert second.planner.costs is not None   # (made after: adopts the first's costs, and reads the memory then)
        for engine in (first, second):
            assert engine.memory_key() == key
            assert engine.planner.overhead == saved.overhead


def test_fixed_width_cycles_teach_the_memory_too(prop, cache_dir):
    """A request with a fixed block is not planned, but its cycles are observed (the slots' acceptance):
    what they taught is written as well."""
    with Engine.load(prop, **dict(F32, n_threads=None)) as engine:      # (threads left open: calibrated)
        out = [t for c in engine.generate(prop.tokenize(PROMPTS[1]), Settings(mode="lossless", block=4, max_new=16))
               for t in c.committed]
        assert out == greedy_ar(prop, prop.tokenize(PROMPTS[1]), 16, **F32)
        assert engine.planner.elapsed == 0 and engine.planner.stats["lossless"].n_cycles > 0
    (entry,) = json.loads(calibrate.memory_path().read_text())["entries"].values()
    assert entry["stats"]["lossless"]["n_cycles"] == engine.planner.stats["lossless"].n_cycles


def test_prepare_makes_the_first_plans_before_anything_is_timed(prop):
    """Engine.prepare (front ends call it before timing) leaves the planner with the current choice and
    the lookup table an empty request record starts from (Planner.warm), so a fresh engine's first
    request does not make them between its passes; the output is unchanged."""
    s = Settings(mode="lossless", block="auto", max_new=24)
    with Engine.load(prop, **F32) as engine:
        assert engine.prepare(s)
        pl = engine.planner
        assert "lossless" in pl.current and "lossless" in pl._fresh
        replans = []
        replan = pl._replan
        pl._replan = lambda *a, **k: replans.append(1) or replan(*a, **k)
        cycles = list(engine.generate(prop.tokenize(PROMPTS[1]), s))
        assert [t for c in cycles for t in c.committed] == greedy_ar(prop, prop.tokenize(PROMPTS[1]), 24, **F32)
        assert len(replans) <= len(cycles) // pl.replan_every       # (none at the first cycle)


def test_a_model_file_gone_while_decoding_loses_only_the_memory(tmp_path, cache_dir):
    """The memory is keyed by the model file's size and mtime: a file deleted after loading (a download
    replaced) leaves nothing to key it by, and the request ends as usual, its output intact."""
    import shutil

    path = tmp_path / "gone.gguf"
    shutil.copy(tiny_gguf(tmp_path / "src", seed=0), path)
    with Model(path) as m, Engine.load(m, **F32) as engine:
        s = Settings(mode="lossless", block="auto", max_new=12)
        engine.prepare(s)
        path.unlink()
        out = [t for c in engine.generate(m.tokenize(PROMPTS[1]), s) for t in c.committed]
        assert out == greedy_ar(m, m.tokenize(PROMPTS[1]), 12, **F32)
    assert not calibrate.memory_path().exists() or not json.loads(calibrate.memory_path().read_text())["entries"]
