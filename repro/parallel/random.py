"""Model-parallel RNG (paper Appendix B.2) and activation checkpointing that replays it.

Two streams of randomness:
  * outside tensor-parallel regions (embedding and residual dropout): the device's default
    generator, seeded identically on every rank of a TP group, so every TP rank drops the same
    elements of the replicated activations;
  * inside tensor-parallel regions (attention-probability dropout, where each rank owns different
    heads): a separate state per TP rank, seeded `seed + 2718 + tp_rank` as in the 2020 code.

`RNGTracker.fork()` swaps the TP-region state into the default generator for the duration of a
block, so any op (F.dropout, scaled_dot_product_attention) draws from it unchanged.

With one TP rank there is nothing to tell apart: the models fork only at TP > 1
(`tp_region_tracker`), and at TP = 1 attention dropout draws from the default stream, as hidden
dropout does. Dynamo cannot trace the fork's get/set_rng_state (each one cuts the compiled graph, two
cuts a layer), so this keeps the TP = 1 step one graph, activation checkpointing included.
(Megatron-LM forks at TP = 1 too; the masks differ, their distribution does not.)
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.utils.checkpoint

TP_REGION_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _default_generator(device: torch.device) -> torch.Generator:
    """The default generator of `device` itself (for CUDA: of that GPU, not of the current one)."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.cuda.default_generators[index]
    return torch.default_generator


def seed_default_generators(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and, on GPU, the device's generator (same seed on all TP ranks)."""
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def tp_region_tracker(rng: "RNGTracker | None", tp_size: int) -> "RNGTracker | None":
    """The tracker a model's attention dropout forks into: `rng` at TP > 1, None for one TP rank."""
    return rng if tp_size > 1 else None


class RNGTracker:
    """Owns the TP-region generator state of one rank; pass it to the model explicitly."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seed = seed + TP_REGION_SEED_OFFSET + tp_rank
        self._state = self._fresh_state(self.seed)

    def _fresh_state(self, seed: int) -> torch.Tensor:
        saved = _get_state(self.device)  # also initialises CUDA, so default_generators is filled
        _default_generator(self.device).manual_seed(seed)
        fresh = _get_state(self.device)
        _set_state(self.device, saved)
        return fresh

    @contextlib.contextmanager
    def fork(self):
        """Run the block with the TP-region state; advance it; restore the default state."""
        saved = _get_state(self.device)
        _set_state(self.device, self._state)
        try:
            yield
        finally:
            self._state = _get_state(self.device)
            _set_state(self.device, saved)

    def get_state(self) -> torch.Tensor:
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()


def _replay_contexts(tracker: RNGTracker | None):
    """Context managers for torch's checkpoint: recompute sees the tracker state of the forward."""
    snapshot = tracker.get_state() if tracker is not None else None

    @contextlib.contextmanager
    def recompute():
        if tracker is None:
            yield
            return
        current = tracker.get_state()
        tracker.set_state(snapshot)
        try:
            yield
        finally:
            tracker.set_state(current)

    return contextlib.nullcontext(), recompute()


def checkpoint(fn: Callable, *args, tracker: RNGTracker | None = None):
    """Activation checkpointing that replays both RNG streams on recompute.

    torch restores the default CPU/CUDA generators (`preserve_rng_state`); the context function
    restores the TP-region tracker, so dropout inside and outside TP regions replays identically.
    Pass `tracker` only when the block draws from it (attention dropout > 0): without one, a
    compiled caller traces the checkpoint into its graph.
    """
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return _checkpoint_replaying(fn, *args, tracker=tracker)


@torch.compiler.disable
def _checkpoint_replaying(fn: Callable, *args, tracker: RNGTracker):
    """The tracker's checkpoint, always eager, the block inside it too. Dynamo cannot trace the
    tracker's get/set_rng_state nor a context_fn: under torch.compile it used to drop the context_fn,
    so the backward's recompute drew the attention-dropout masks from an advanced tracker state and
    the gradients were not those of the forward (seen: the wrong sign in a finite-difference check).
    Recursive, so forward and recompute both draw from torch's generators, not inductor's."""
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: _replay_contexts(tracker),
    )
