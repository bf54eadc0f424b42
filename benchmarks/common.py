"""Shared benchmark machinery: model setup, paired timing, token/forward counting, peak RSS, results.

Benchmarks drive continuum through its public API only, plus ONE hook the tests use too: PyTorch forward
hooks on the wrapped Hugging Face module (``model.model.register_forward_pre_hook`` / ``register_forward_hook``,
as ``tests/conftest.py``'s ``count_forward_tokens``): :class:`ForwardCounter` and :class:`KVPeak` are built on it.

Measurement protocol (every scenario):

* one warm-up call of each side, not measured;
* ``reps`` repetitions, each running the baseline and continuum back to back, alternating which
  goes first, so slow drifts of a shared machine hit both sides alike;
* the figure is the MEDIAN of the per-repetition ratios (a paired estimate); the times shown are
  the medians of each side.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(os.environ.get("CONTINUUM_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))

# Plain English-like text used to build prompts and histories of an exact token length.
CORPUS = (
    "The harbour town woke slowly. Fishing boats came back with the tide, and the market filled with "
    "voices, baskets and the smell of bread. Anna walked along the quay to the old library, where she "
    "kept a notebook of every ship that entered the bay. Her grandfather had started the notebook fifty "
    "years ago, and each page held a name, a date, a flag and a short line about the weather. "
    "That morning the sky was clear, the wind came from the west, and a tall ship with grey sails waited "
    "outside the breakwater. Nobody in the town knew its name. The harbour master climbed the tower with "
    "his telescope, the children ran to the end of the pier, and the baker forgot his ovens for a while. "
    "When the ship finally moved, it turned not toward the harbour but along the coast, past the cliffs "
    "and the lighthouse, until only the top of its mast could be seen above the rocks. "
)


# ---------------------------------------------------------------------------------------------- env
# gc.collect() before every measured call keeps one call's garbage out of the next one's time and peak
# RSS; it costs ~0.5 s a call with transformers loaded, which a --smoke run (no figure checked) skips.
COLLECT = True


def collect() -> None:
    if COLLECT:
        gc.collect()


def configure_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        return None


# ---------------------------------------------------------------------------------------------- RSS
def _read_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # kB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    kb = _read_status("VmHWM")
    if kb is None:  # fall back to the process-lifetime peak
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024.0


# ---------------------------------------------------------------------------------------------- model
class Skip(Exception):
    """Raised by a scenario that cannot run here (a fixture or an optional package is missing): the
    runner prints ``<id>: skipped (<reason>)`` and goes on with the next scenario."""


@dataclass
class Bench:
    """The model under test, shared by all scenarios."""

    hf: object
    tok: object  # the Hugging Face tokenizer
    model: object  # continuum.models.Transformers
    name: str
    random_weights: bool
    counter: ForwardCounter
    notes: list = field(default_factory=list)
    force_length: bool = False  # a real model: suppress EOS on both sides so they generate the same counts

    @property
    def context(self) -> int:
        return self.model.context_length or 1024

    @property
    def pad_id(self) -> int:
        tok = self.tok
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _gpt2_tokenizer(notes: list):
    from transformers import AutoTokenizer

    path = FIXTURES / "tokenizers" / "gpt2"
    if path.exists():
        return AutoTokenizer.from_pretrained(str(path)), "GPT-2 tokenizer (fixtures)"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 20, trainer)
    notes.append(f"no GPT-2 tokenizer at {path}: trained a byte-level BPE ({tok.get_vocab_size()} tokens) on the fly")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                     unk_token="<|endoftext|>")
    return hf_tok, "byte-level BPE trained on the fly"


def load_bench(model_path: str | None = None, seed: int = 0, tiny: bool = False) -> Bench:
    """The benchmark model: GPT-2-small-shaped with random fp32 weights, or ``model_path``.

    ``tiny`` (``--smoke``): a 2-layer, 64-wide random GPT-2 over the same tokenizer, so that every
    scenario runs in seconds; its figures mean nothing.

    Example:
        >>> bench = load_bench(tiny=True)          # doctest: +SKIP
        >>> bench.model.tokens_computed
        0
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from continuum import models

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    notes: list[str] = []
    if model_path:
        tok = AutoTokenizer.from_pretrained(model_path)
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        name, random_weights = f"{model_path} ({type(hf).__name__}, fp32)", False
    else:
        tok, tok_name = _gpt2_tokenizer(notes)
        vocab = 50257 if len(tok) <= 50257 and tok_name.startswith("GPT-2") else len(tok)
        size = {"n_layer": 2, "n_embd": 64, "n_head": 2} if tiny else {}
        cfg = GPT2Config(vocab_size=vocab, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **size)
        hf = GPT2LMHeadModel(cfg).eval()
        shape = f"{cfg.n_layer} layers, {cfg.n_embd} wide, vocab {cfg.vocab_size}"
        kind = "tiny GPT-2" if tiny else "GPT-2-small-shaped"
        name, random_weights = f"{kind} random fp32 ({shape}; {tok_name})", True
    hf.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = models.Transformers(hf, tok)
    if not random_weights:
        # same number of tokens on both sides: HF gets min_new_tokens, continuum stops treating EOS as the end
        model.tokenizer.eos_token_ids = frozenset()
        notes.append("real model: EOS never ends a generation (HF: min_new_tokens; continuum: empty eos_token_ids)")
    return Bench(hf=hf, tok=tok, model=model, name=name, random_weights=random_weights,
                 counter=ForwardCounter(hf), notes=notes, force_length=not random_weights)


def make_text(tok, n_tokens: int, offset: int = 0) -> str:
    """Text that the tokenizer encodes (with its default special tokens) to about ``n_tokens`` tokens."""
    special = len(tok("", add_special_tokens=True)["input_ids"])
    body = CORPUS * (2 + (n_tokens * 6) // len(CORPUS))
    ids = tok(body[offset:], add_special_tokens=False)["input_ids"]
    want = max(1, n_tokens - special)
    best = None
    for k in range(want, max(0, want - 8), -1):
        text = tok.decode(ids[:k])
        n = len(tok(text, add_special_tokens=True)["input_ids"])
        if n == n_tokens:
            return text
        if best is None or abs(n - n_tokens) < abs(best[1] - n_tokens):
            best = (text, n)
    return best[0]


def n_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=True)["input_ids"])


# ---------------------------------------------------------------------------------------------- counting
class ForwardCounter:
    """Counts positions passed to the HF model and the wall time spent inside its ``forward``."""

    def __init__(self, hf):
        self.tokens = 0
        self.calls = 0
        self.seconds = 0.0
        self._t0 = 0.0
        hf.register_forward_pre_hook(self._pre, with_kwargs=True)
        hf.register_forward_hook(self._post)

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.tokens += ids.numel()
        self.calls += 1
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._t0

    def snapshot(self) -> tuple[int, int, float]:
        return self.tokens, self.calls, self.seconds


def _cache_tensors(cache) -> list:
    """The key and value tensors of a transformers ``Cache`` (its ``layers``), or of nothing."""
    return [t for layer in getattr(cache, "layers", None) or () for t in (layer.keys, layer.values) if t is not None]


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of storage behind ``tensors``, each storage counted once (also across calls sharing ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def kv_bytes(state, seen: set | None = None) -> int:
    """Bytes of KV storage a state holds (``state.kv_cache``: its tensors, not copies), shared storage once."""
    return storage_bytes(_cache_tensors(state.kv_cache), seen)


class KVPeak:
    """Peak KV bytes of one model forward (its input cache + the cache it returns, shared storage once), read
    with forward hooks on the Hugging Face module while the ``with`` block runs.

    Example:
        >>> with KVPeak(model.model) as peak:      # doctest: +SKIP
        ...     gen(prompts)
        >>> peak.peak                                # bytes
    """

    def __init__(self, hf):
        self.hf, self.peak, self._input, self._handles = hf, 0, [], []

    def _pre(self, module, args, kwargs):
        # the cache object is updated in place by the forward: remember its tensors as they come in
        self._input = _cache_tensors(kwargs.get("past_key_values", kwargs.get("cache")))

    def _post(self, module, args, output):
        seen: set = set()
        held = storage_bytes(self._input, seen) + storage_bytes(_cache_tensors(getattr(output, "past_key_values", None)), seen)
        self.peak, self._input = max(self.peak, held), []

    def __enter__(self) -> KVPeak:
        self._handles = [self.hf.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.hf.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class Call:
    """One measured call."""

    seconds: float
    cpu_seconds: float  # process CPU time (all threads): less sensitive than wall time to other processes
    generated: int  # new tokens per row, as returned by the measured function
    computed: int  # positions passed to the model's forward
    forward_calls: int
    forward_seconds: float
    peak_rss_mb: float
    extra: dict = field(default_factory=dict)


def measure(bench: Bench, fn: Callable[[], object]) -> Call:
    """Run ``fn`` once, timed. ``fn`` returns the number of new tokens (or a dict with ``generated``)."""
    collect()
    reset_peak_rss()
    t0, c0, f0 = bench.counter.snapshot()
    cpu0 = time.process_time()
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    t1, c1, f1 = bench.counter.snapshot()
    extra = dict(out) if isinstance(out, dict) else {"generated": out}
    generated = int(extra.pop("generated", 0) or 0)
    return Call(seconds, cpu, generated, t1 - t0, c1 - c0, f1 - f0, peak_rss_mb(), extra)


def paired(bench: Bench, baseline: Callable, candidate: Callable, reps: int, warmup: int = 1,
           log: Callable[[str], None] | None = None) -> tuple[list[Call], list[Call]]:
    """Warm up, then ``reps`` back-to-back pairs (alternating order). Returns (baseline calls, continuum calls)."""
    for _ in range(warmup):
        baseline()
        candidate()
    base, cand = [], []
    for i in range(reps):
        if i % 2 == 0:
            b = measure(bench, baseline)
            c = measure(bench, candidate)
        else:
            c = measure(bench, candidate)
            b = measure(bench, baseline)
        base.append(b)
        cand.append(c)
        if log:
            log(f"    rep {i + 1}/{reps}: baseline {b.seconds:.3f}s  continuum {c.seconds:.3f}s  "
                f"ratio {c.seconds / b.seconds:.3f}")
    return base, cand


def median(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------- results
@dataclass
class Row:
    """One checked figure."""

    id: str
    title: str
    baseline: str  # what the baseline is
    figure: float  # the checked value
    op: str  # "<=" or ">="
    threshold: float
    unit: str  # "x time" (continuum / baseline) or "x faster" (baseline / continuum) or "x memory"...
    base_s: float | None = None
    cont_s: float | None = None
    base_tps: float | None = None
    cont_tps: float | None = None
    base_rss_mb: float | None = None
    cont_rss_mb: float | None = None
    base_computed: int | None = None
    cont_computed: int | None = None
    reps: int = 0
    notes: list = field(default_factory=list)
    achievable: str | None = None  # when the target cannot be met on this machine: why, and the best achievable
    # For ``--plot``: {"title": str, "x": [...], "xlabel": str, "ylabel": str, "lines": {label: [y, ...]},
    # "log_y": bool (optional)}; a scenario that has per-turn / per-call figures fills it.
    series: dict | None = None
    checked: bool = True  # False in a --smoke run: the figure is shown, the target is not checked

    @property
    def passed(self) -> bool:
        if self.figure is None or math.isnan(self.figure):
            return False
        return self.figure <= self.threshold if self.op == "<=" else self.figure >= self.threshold

    @property
    def target(self) -> str:
        return f"{self.op} {self.threshold:g}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["passed"], d["target"] = self.passed, self.target
        return d


def row_from_calls(id: str, title: str, baseline: str, base: list[Call], cont: list[Call], *, op: str, threshold: float,
                   speedup: bool, unit: str | None = None, notes=None) -> Row:
    """A row whose figure is the median paired time ratio (continuum/baseline), or its inverse when ``speedup``."""
    ratios = [c.seconds / b.seconds for b, c in zip(base, cont)]
    fig = median([1.0 / r for r in ratios]) if speedup else median(ratios)
    cpu = median([b.cpu_seconds / c.cpu_seconds if speedup else c.cpu_seconds / b.cpu_seconds for b, c in zip(base, cont)])
    notes = list(notes or []) + [f"per-rep wall ratios {' '.join(f'{r:.3f}' for r in ratios)} (continuum/baseline); "
                                 f"CPU-time figure {cpu:.3f}"]
    b_s, c_s = median([b.seconds for b in base]), median([c.seconds for c in cont])
    b_gen, c_gen = median([b.generated for b in base]), median([c.generated for c in cont])
    return Row(id=id, title=title, baseline=baseline, figure=fig, op=op, threshold=threshold,
               unit=unit or ("x faster" if speedup else "x time"), base_s=b_s, cont_s=c_s,
               base_tps=b_gen / b_s if b_s and b_gen else None, cont_tps=c_gen / c_s if c_s and c_gen else None,
               base_rss_mb=max(b.peak_rss_mb for b in base) if base else None,
               cont_rss_mb=max(c.peak_rss_mb for c in cont) if cont else None,
               base_computed=int(median([b.computed for b in base])) if base else None,
               cont_computed=int(median([c.computed for c in cont])) if cont else None,
               reps=len(cont), notes=notes)


def _fmt(x, spec: str, none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


COLUMNS = ["id", "scenario", "baseline s", "continuum s", "figure", "target", "check", "tok/s base|cont",
           "peak RSS MB base|cont", "tokens computed base|cont"]


def table_cells(r: Row) -> list[str]:
    return [
        r.id, r.title, _fmt(r.base_s, ".3f"), _fmt(r.cont_s, ".3f"),
        _fmt(r.figure, ".3f") + " " + r.unit, r.target, ("PASS" if r.passed else "FAIL") if r.checked else "-",
        f"{_fmt(r.base_tps, '.1f')} | {_fmt(r.cont_tps, '.1f')}",
        f"{_fmt(r.base_rss_mb, '.0f')} | {_fmt(r.cont_rss_mb, '.0f')}",
        f"{_fmt(r.base_computed, 'd')} | {_fmt(r.cont_computed, 'd')}",
    ]


def format_table(rows: list[Row]) -> str:
    cells = [COLUMNS] + [table_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths))  # noqa: E731
    out = [line(COLUMNS), "  ".join("-" * w for w in widths)] + [line(c) for c in cells[1:]]
    return "\n".join(out)


def format_markdown(rows: list[Row]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in table_cells(r)) + " |")
    return "\n".join(out)


def write_json(path: str, meta: dict, rows: list[Row]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, f, indent=2, default=str)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a scenario starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_threads(n: int, fn: Callable[[int], Any], timeout: float | None = None,
               tolerate: bool = False) -> tuple[list, float]:
    """``fn(i)`` for i in 0..n-1, each on its own thread (concurrent clients): (results, wall seconds). The first
    error is raised after every thread ended, unless ``tolerate`` (then logged, its result None); a thread still
    running after ``timeout`` seconds is an error."""
    import threading

    out: list = [None] * n
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported after the join
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"clients still running after {timeout:g} s")
    if errors and not tolerate:
        raise errors[0]
    for exc in errors:
        log(f"    a client failed: {type(exc).__name__}: {exc}")
    return out, time.perf_counter() - t0


def stop_process(proc: Any, grace: float = 10.0) -> None:
    """Terminate a server process a test or scenario started (SIGTERM, then SIGKILL after ``grace`` seconds)."""
    import subprocess

    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LoopbackProcess:
    """A process serving HTTP on ``127.0.0.1:port``, its output in a log file (``_log``, open while it runs):
    ``base`` and ``url`` (its ``/v1``), ``stop()``. ``Server`` (benchmarks/replicas.py) and ``Gateway``
    (benchmarks/gateway.py) start theirs."""

    port: int
    proc: Any
    _log: Any

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def stop(self) -> None:
        if self._log.closed:
            return
        stop_process(self.proc)
        self._log.close()


def wait_healthy(proc: Any, url: str, what: str, timeout: float = 300, output: Callable[[], str] | None = None,
                 loaded: bool = True, interval: float = 0.3) -> None:
    """Wait until ``url``/health answers 200 (``loaded``: with its engine loaded, not continuum's ``"starting"``,
    which accepts requests while the engine loads); raise (with the process's last output: ``output()``, default
    its piped stderr) if ``proc`` exits or ``timeout`` seconds pass (then it is killed). The server tests and
    B21s use it too (B21s times the first 200, polling every 10 ms)."""
    import httpx

    def tail() -> str:
        return output() if output is not None else proc.stderr.read().decode()[-2000:] if proc.stderr else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{tail()}")
        try:
            r = httpx.get(f"{url}/health", timeout=1)
            if r.status_code == 200 and not (loaded and "starting" in r.text):
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    proc.kill()
    raise RuntimeError(f"{what} did not start in {timeout:g} s" + (f":\n{output()}" if output is not None else ""))
