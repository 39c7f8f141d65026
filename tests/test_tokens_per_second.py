"""The one definition of tokens/s (engine.tokens_per_second, docs/design.md "Tokens per second"): generated
tokens ÷ the time from the start of the first cycle to the end of the last. The prompt's prefill is
not in it; the time a consumer spends between cycles is. Timed with a scripted clock (every eval of
n tokens costs n units), so the expected numbers are exact and no wall-clock threshold is needed."""
from types import SimpleNamespace

from prove_local import engine as engine_mod
from prove_local.engine import Engine, Settings, summarize, tokens_per_second
from tests.fakes import FakeContext, onehot

V, EOS = 20, 19


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedContext(FakeContext):
    """A fake context whose eval of n tokens advances the clock by n units."""

    def __init__(self, clock: Clock):
        super().__init__(lambda prefix: onehot(V, (prefix[-1] + 1) % (V - 1)), V)
        self.clock = clock

    def eval(self, tokens, rows=None):
        self.clock.t += len(tokens)
        return super().eval(tokens, rows)


def test_decode_time_runs_from_the_first_cycle_to_the_last_without_prefill(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(engine_mod, "time", SimpleNamespace(perf_counter=clock))
    engine = Engine({"target": TimedContext(clock)}, is_eog=lambda t: t == EOS, mask_token=None, n_ctx=64)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    gen = engine.generate(prompt, Settings(mode="ar", max_new=5))
    cycles = []
    for c in gen:                       # the consumer works 100 units after every cycle
        cycles.append(c)
        clock.t += 100
    request = gen.request
    # prefill: 8 tokens (8 units); then 5 one-token cycles of 1 unit, 100 units apart
    assert request.prefill == (8, 8.0)
    assert [c.seconds for c in cycles] == [1.0] * 5
    assert request.decode_seconds == 5 * 1 + 4 * 100          # not the last wait, not the prefill
    assert summarize(cycles, request.decode_seconds)["tokens_per_second"] == 5 / 405
    assert tokens_per_second(5, 405.0) == 5 / 405 and tokens_per_second(5, 0.0) == 0.0


def test_no_cycle_no_decode_time(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(engine_mod, "time", SimpleNamespace(perf_counter=clock))
    engine = Engine({"target": TimedContext(clock)}, is_eog=lambda t: t == EOS, mask_token=None, n_ctx=64)
    gen = engine.generate([1, 2, 3], Settings(mode="ar", max_new=0))
    assert list(gen) == [] and gen.request.decode_seconds == 0.0
