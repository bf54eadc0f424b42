"""The runner's settings: sizes and repetitions per mode (full, ``--quick``, ``--smoke``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Config", "QUICK", "SMOKE_SIZES"]

# --quick: the scenarios behind the README's claims (reuse across turns and cuts, forks, JSON, the engine's shared
# step, llama.cpp, speculation, the server's start), sized to finish in <= 5 minutes on 2 idle cores; the others
# run in the full mode or with --only (the runner lists them)
QUICK = ("B1", "B3", "B4", "B5", "B6", "B7", "B9", "B22", "B24", "B25", "B21S")

# --smoke: the sizes of the scenarios outside this module (each reads ``getattr(cfg, name, its default)``)
SMOKE_SIZES: dict = {
    "b12_turns": 2, "b12_new": 2, "b12_inner": 1,
    "b13_calls": 2, "b13_prefix": 40, "b13_new": 2,
    "b14_layers": 1, "b14_width": 64, "b14_new": 2, "b14_turns": 2, "b14_turn_new": 2, "b14_reps": 1,
    "b15_hf": False, "b15_n": 2, "b15_new": 2,
    "b16_sessions": 2, "b16_turns": 2, "b16_user": 8, "b16_new": 2,
    "b17_n": 2, "b17_levels": 2, "b17_new": 2,
    "b18_n": 2, "b18_prefix": 40, "b18b_rows": 2, "b18b_prefix": 40,
    "b19_n": 2, "b19_article": 40, "b19_new": 2,
    "b20_n": 2, "b20_doc": 40,
    "b21_new": 2, "b21_doc": 30,
    "b22_new": 2, "b22_sizes": (2,), "b22_steps": (1,), "b22e_calls": 10,
    "b23_budget": 8, "b23_answer": 8, "b23_turns": 2,
}


@dataclass
class Config:
    quick: bool = False
    smoke: bool = False  # --smoke: each scenario once at toy size, no targets (see smoke_mode)
    reps: int = 5  # repetitions of the cheap scenarios (B4, B5, B8)
    b1_reps: int = 9  # B1/B2 sit at parity with HF: more pairs for a stable median
    heavy_reps: int = 3  # repetitions of the expensive ones (B3, B7)
    b1_prompt: int = 32
    b1_new: int = 64
    b3_history: int = 600
    b3_turns: int = 8
    b3_new: int = 32
    b3_ttft_inner: int = 3  # continuum TTFT calls per turn (median), they are cheap
    b4_history: int = 600
    b4_new: int = 32
    b4_cut: int = 200
    b5_max: int = 160
    b6_reps: int = 3
    b7_prompt: int = 512
    b7_new: int = 32
    b7_samples: int = 8
    b8_new: int = 32
    b8_beams: int = 4
    b9_prompt: int = 512
    b9_samples: int = 8
    b11_batch: int = 4
    b11_prompt: int = 128
    b11_new: int = 32
    clients: int | None = None  # B21's concurrent clients (None: 16; quick 4)

    @classmethod
    def quick_mode(cls) -> Config:
        return cls(quick=True, reps=3, b1_reps=3, heavy_reps=1, b1_new=32, b3_turns=4, b3_new=8, b3_ttft_inner=2, b4_new=8,
                   b5_max=48, b6_reps=1, b7_prompt=256, b7_new=8, b8_new=16, b11_batch=2, b11_prompt=64, b11_new=8)

    @classmethod
    def smoke_mode(cls) -> Config:
        """``--smoke``: every scenario once, on the tiny model, a few tokens each: it proves the scenario
        runs (CI runs it: ``tests/test_benchmarks_smoke.py``); its figures mean nothing.

        Example:
            >>> Config.smoke_mode().b1_new
            3
        """
        cfg = cls(quick=True, smoke=True, reps=1, b1_reps=1, heavy_reps=1, b1_prompt=8, b1_new=3, b3_history=40, b3_turns=2,
                  b3_new=2, b3_ttft_inner=1, b4_history=40, b4_new=2, b4_cut=20, b5_max=12, b6_reps=1, b7_prompt=16,
                  b7_new=2, b7_samples=2, b8_new=2, b8_beams=2, b9_prompt=16, b9_samples=2, b11_batch=2, b11_prompt=8,
                  b11_new=2, clients=2)
        vars(cfg).update(SMOKE_SIZES)
        return cfg

    def describe(self) -> str:
        if self.smoke:
            return "smoke: every scenario once at toy size (tiny model, a few tokens), targets not checked"
        return (f"reps={self.reps} (B1/B2: {self.b1_reps}, B3/B7: {self.heavy_reps}), "
                f"B1/B2 {self.b1_prompt}+{self.b1_new} tokens, "
                f"B3 {self.b3_turns} turns x {self.b3_new} new on {self.b3_history} tokens, "
                f"B4 cut {self.b4_cut} chars of {self.b4_history}+{self.b4_new} tokens, B5 <= {self.b5_max} tokens, "
                f"B7 {self.b7_samples} x {self.b7_new} new on {self.b7_prompt}, B8 {self.b8_beams} beams x {self.b8_new}, "
                f"B9 {self.b9_samples} samples on {self.b9_prompt}, B11 {self.b11_batch} x {self.b11_prompt}+{self.b11_new} CFG")
