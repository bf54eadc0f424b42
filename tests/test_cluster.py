"""``continuum.cluster``: programs on Ray actors (real Ray, a local instance of 2 CPUs) and through Ray Data.

The reference is ``continuum.run_batch(make_program(), inputs)`` in this process. Each actor builds the
same tiny GPT-2 (seeded) over the same BPE tokenizer (trained on the fly), so greedy programs give the
same results everywhere. Ray workers import this module (to unpickle ``make_program``) and ``conftest``:
the fixture puts ``tests/`` on their ``PYTHONPATH``.
"""

from __future__ import annotations

import _thread
import functools
import os
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import continuum
from continuum import cluster, continuous, generate, models, samplers
from continuum.errors import ContinuumTypeError, GeneratorArgumentError, ProgramError

from conftest import make_bpe_tokenizer, tiny_gpt2

TESTS = Path(__file__).resolve().parent
PROMPTS = ["Once upon a time", "The quick brown fox", "Le café est", "Numbers: 0 1 2", "She said", "Review: great",
           "The dog sleeps", "Emoji time", "def f(x):", "Paris is", "The king", "A bird"]


class Refused(ValueError):
    """A program's own exception: it must arrive as itself, not as Ray's RayTaskError."""


class TwoArgs(Exception):
    """Pickles but does not unpickle (``__init__`` takes two arguments): arrives as a RuntimeError with its text."""

    def __init__(self, a: str, b: int):
        super().__init__(f"{a}/{b}")


def _model():
    tok = make_bpe_tokenizer()
    hf = tiny_gpt2(len(tok))
    hf.config.eos_token_id = hf.generation_config.eos_token_id = tok.eos_token_id
    return models.Transformers(hf, tok)


def make_program():
    """Greedy text, then a choice on the continued state; plain strings out (they leave the actor)."""
    model = _model()
    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" yes", " no"], samplers.greedy()))

    def program(prompt: str) -> tuple[str, str]:
        if prompt.startswith("refuse"):
            raise Refused(f"no: {prompt}")
        if prompt.startswith("odd"):
            raise TwoArgs(prompt, 2)
        s = text(prompt, max_tokens=6)
        return str(s), pick(s + " Sure?").value

    return program


def make_program_that_fails():
    raise Refused("cannot load the model")


def make_slow_program():
    def program(x):
        time.sleep(60)  # only Ctrl-C ends it
        return x

    return program


def make_role_program(folder: str):
    """The first actor ready is slow (3 s per input), the other fast: the fast one must take most inputs."""
    try:
        os.close(os.open(os.path.join(folder, "slow"), os.O_CREAT | os.O_EXCL))  # atomic: one actor wins
        role, pause = "slow", 3.0
    except FileExistsError:
        role, pause = "fast", 0.01

    def program(x):
        time.sleep(pause)
        return role

    return program


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # the workers import this module and conftest (tests/) and continuum (the repo root, when not installed)
    path = os.pathsep.join(p for p in [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")] if p)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    return continuum.run_batch(make_program(), PROMPTS)


def test_two_actors_give_the_one_process_results_in_input_order(reference, capsys):
    assert all(isinstance(text, str) and choice in (" yes", " no") for text, choice in reference)
    assert cluster.run_batch(make_program, PROMPTS, actors=2, concurrency=4, progress=True) == reference
    err = capsys.readouterr().err  # the progress bar
    assert "cluster.run_batch" in err and "12/12" in err


def test_errors_arrive_as_raised_gathered_in_program_error(reference):
    inputs = ["refuse 1", PROMPTS[0], "odd one", PROMPTS[1], "refuse 2"]
    with pytest.raises(ProgramError) as info:
        cluster.run_batch(make_program, inputs, actors=2, concurrency=4)
    err = info.value
    assert err.results == [None, reference[0], None, reference[1], None]
    assert list(err.errors) == [0, 2, 4]
    assert type(err.errors[0]) is Refused and str(err.errors[0]) == "no: refuse 1"
    assert isinstance(err.errors[0].__cause__, cluster.RemoteTraceback)  # where it was raised, in the actor
    assert "raise Refused" in err.errors[0].__cause__.text
    assert type(err.errors[2]) is RuntimeError and "TwoArgs" in str(err.errors[2]) and "odd one/2" in str(err.errors[2])
    assert type(err.__cause__) is Refused and "3 of 5" in str(err)


def test_a_generator_of_inputs_is_pulled_lazily_and_exceptions_come_in_place(reference):
    pulled = []

    def inputs():
        for p in [*PROMPTS[:6], "refuse me"]:
            pulled.append(p)
            yield p

    out = cluster.run_batch(make_program, inputs(), actors=1, concurrency=4, chunk_size=2, return_exceptions=True)
    assert out[:6] == reference[:6] and type(out[6]) is Refused and str(out[6]) == "no: refuse me"
    assert pulled == [*PROMPTS[:6], "refuse me"]


def test_inputs_stream_to_the_actor_that_is_free(tmp_path):
    roles = cluster.run_batch(functools.partial(make_role_program, str(tmp_path)), range(10), actors=2, concurrency=1)
    assert roles.count("slow") <= 2 and roles.count("fast") >= 8  # a fixed split would give each 5


def test_make_program_failing_in_the_actor_raises_its_exception():
    t0 = time.perf_counter()
    with pytest.raises(Refused, match="cannot load the model"):
        cluster.run_batch(make_program_that_fails, PROMPTS, actors=1)
    # (a hang guard: the program fails at once, and what takes time is the Ray worker's start, torch imported in a
    # fresh process: 45 s once on a slowed, contended 2-core machine, where 30 s was the bound)
    assert time.perf_counter() - t0 < 120


@pytest.mark.parametrize("kwargs, error, match", [
    ({"make_program": "model"}, ContinuumTypeError, "make_program must be a callable"),
    ({"inputs": "one prompt"}, ContinuumTypeError, "single string"),
    ({"inputs": 3}, ContinuumTypeError, "iterable"),
    ({"actors": 0}, GeneratorArgumentError, "actors must be >= 1"),
    ({"actors": 1.5}, ContinuumTypeError, "actors must be an int"),
    ({"concurrency": 0}, GeneratorArgumentError, "concurrency must be >= 1"),
    ({"cpus_per_actor": -1}, GeneratorArgumentError, "cpus_per_actor"),
    ({"cpus_per_actor": "1"}, ContinuumTypeError, "cpus_per_actor"),
    ({"chunk_size": 0}, GeneratorArgumentError, "chunk_size"),
    ({"progress": 1}, GeneratorArgumentError, "progress must be True or False"),
    ({"return_exceptions": None}, GeneratorArgumentError, "return_exceptions"),
])
def test_bad_arguments_raise_continuum_errors_before_any_actor(kwargs, error, match):
    args = {"make_program": make_program, "inputs": PROMPTS, **kwargs}
    with pytest.raises(error, match=match):
        cluster.run_batch(args.pop("make_program"), args.pop("inputs"), **args)


def test_ctrl_c_cancels_and_kills_the_actors(python_ctrl_c):
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # the earlier tests' actors are gone (else "all CPUs taken" below could be theirs)
    assert ray.available_resources().get("CPU", 0) == 2

    def interrupt():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # once both actors run a chunk (the CPUs Ray lends are all taken)
            if ray.available_resources().get("CPU", 0) == 0:
                time.sleep(1.0)
                break
            time.sleep(0.1)
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        cluster.run_batch(make_slow_program, range(8), actors=2, concurrency=2)
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2  # the actors are gone: their CPUs are free again


def test_programs_in_ray_data_map_batches(reference):
    pytest.importorskip("ray.data")
    pytest.importorskip("pyarrow")
    ds = ray.data.from_items(PROMPTS[:6])
    out = ds.map_batches(cluster.Programs, fn_constructor_args=(make_program,), fn_constructor_kwargs={"concurrency": 4},
                         batch_size=3, concurrency=1).take_all()
    assert sorted(row["item"] for row in out) == sorted(PROMPTS[:6])
    want = dict(zip(PROMPTS, reference))
    assert all(list(row["output"]) == list(want[row["item"]]) for row in out)
