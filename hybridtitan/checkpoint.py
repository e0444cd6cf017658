"""DCP checkpoints in ``dump_folder/checkpoint/step-N``: model, optimizer, LR schedule, data loader, step and RNG.

A run must resume from the last complete checkpoint, and a save must never leave a folder that looks complete but is
not. That is why this module does not use torchtitan's CheckpointManager. Each save writes ``step-N.partial``. Once all
ranks have finished, rank 0 renames it to ``step-N`` (a rename is atomic) and rewrites ``latest`` atomically. An
interrupted save leaves only a ``.partial`` folder. Resume ignores it and the next save removes it.

Each step folder also holds ``model_args.json`` and ``job_config.json``, so export and evaluation can rebuild the model
from the folder alone.

The model and optimizer states are sharded DTensors. DCP reshards them, so a checkpoint saved by N ranks loads on M
ranks. The data loader and RNG states are per rank (keys ``dataloader.dp_rank_R``). When the data-parallel size changes,
every rank restarts its loader from the saved rank-0 position."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from hybridtitan.errors import CheckpointError, first_error_line
from hybridtitan.models import HybridLM, ModelArgs, build_model
from hybridtitan.models.args import model_args_from_dict, model_args_to_dict

logger = logging.getLogger("hybridtitan")

STEP_RE = re.compile(r"^step-(\d+)$")
MODEL_ARGS_FILE = "model_args.json"
JOB_CONFIG_FILE = "job_config.json"


# ------------------------------------------------------------------------------------------------ reading


def complete_steps(folder: str) -> list[int]:
    """Steps with a complete checkpoint in ``folder`` (a .partial folder is never complete)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def is_model_only(step_dir: str) -> bool:
    """Whether a complete step folder holds only the model, as checkpoint.last_save_model_only and import_hf write it.
    Returns False when the metadata cannot be read. Loading the folder then reports what is wrong."""
    try:
        keys = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 -- any damage (unpickling, I/O) is reported by the load itself
        return False
    return _only_the_model(keys)


def _only_the_model(keys) -> bool:
    return not any(k.startswith("optimizer.") for k in keys)


def resolve_checkpoint(path: str, step: int | None = None) -> str:
    """A step folder from a step folder, a checkpoint folder (its latest step, or ``step``), or a dump folder."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if os.path.isfile(os.path.join(path, ".metadata")):
        if step is not None and not path.rstrip("/").endswith(f"step-{step}"):
            raise CheckpointError(f"{path} is a single checkpoint; it is not step {step}")
        return _with_model_args(path)
    for folder in (path, os.path.join(path, "checkpoint")):
        steps = complete_steps(folder)
        if steps:
            if step is None:
                return _with_model_args(os.path.join(folder, f"step-{steps[-1]}"))
            if step not in steps:
                raise CheckpointError(f"step {step} not found in {folder}; complete steps: "
                                      f"{', '.join(map(str, steps))}")
            return _with_model_args(os.path.join(folder, f"step-{step}"))
    partial = path.rstrip("/").endswith(".partial") or any(
        name.endswith(".partial") for folder in (path, os.path.join(path, "checkpoint")) if os.path.isdir(folder)
        for name in os.listdir(folder))
    if partial:
        raise CheckpointError(f"{path} holds only an incomplete checkpoint (an interrupted save)")
    raise CheckpointError(f"{path} is not a checkpoint: no .metadata and no step-N folders")


def _with_model_args(step_dir: str) -> str:
    if not os.path.isfile(os.path.join(step_dir, MODEL_ARGS_FILE)):
        raise CheckpointError(f"{step_dir} has no {MODEL_ARGS_FILE}: not a hybridtitan checkpoint")
    return step_dir


def read_job_config(step_dir: str) -> dict:
    """The job config a step folder was saved with (OSError if it has none, ValueError if it is damaged)."""
    with open(os.path.join(step_dir, JOB_CONFIG_FILE)) as f:
        return json.load(f)


def load_model_args(step_dir: str) -> ModelArgs:
    path = os.path.join(step_dir, MODEL_ARGS_FILE)
    try:
        with open(path) as f:
            return model_args_from_dict(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"cannot read {path}: {e}") from None


def read_dcp_model_state(step_dir: str, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP step folder, read without building a model. Keys are HybridLM's names and dtypes are
    as stored. Raises CheckpointError if the folder lacks a tensor or disagrees with model_args.json."""
    stored = _stored_model_tensors(step_dir, args)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in stored.items()}
    try:
        dcp.load({"model": state}, checkpoint_id=step_dir, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- CheckpointException is a BaseException
        raise CheckpointError(f"cannot read the model from {step_dir}: {first_error_line(e)}") from None
    return state


def read_dcp_shards(step_dir: str, args: ModelArgs, state: dict[str, torch.Tensor]) -> None:
    """Fills ``state`` from a DCP step folder. ``state`` maps HybridLM's names to a model's own FSDP2-sharded
    parameters. Every rank of the process group reads only the pieces it holds, cast to the parameters' dtype. Raises
    CheckpointError as read_dcp_model_state does."""
    _stored_model_tensors(step_dir, args)
    try:
        dcp.load({"model": state}, checkpoint_id=step_dir)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- CheckpointException is a BaseException
        raise CheckpointError(f"cannot read the model from {step_dir}: {first_error_line(e)}") from None


def _stored_model_tensors(step_dir: str, args: ModelArgs) -> dict:
    """HybridLM name -> the stored tensor's metadata, for every tensor model_args implies, with its shape checked."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(step_dir).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- a partial or foreign folder: one line
        raise CheckpointError(f"cannot read the checkpoint metadata of {step_dir}: {first_error_line(e)}") from None
    stored = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    expected = {k: tuple(v.shape) for k, v in build_model(args, "meta").state_dict().items()}
    missing = sorted(set(expected) - set(stored))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{step_dir} lacks model tensor {missing[0]}{more} that its model_args.json implies")
    for key, shape in expected.items():
        if tuple(stored[key].size) != shape:
            raise CheckpointError(f"{step_dir}: tensor {key} has shape {tuple(stored[key].size)}, but model_args.json "
                                  f"implies {shape}")
    return {k: stored[k] for k in expected}


def load_model(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               step: int | None = None) -> tuple[HybridLM, str]:
    """The model of a checkpoint, in one process (no process group needed); returns it and the step folder."""
    step_dir = resolve_checkpoint(path, step)
    args = load_model_args(step_dir)
    model = build_model(args, "meta")
    model.to_empty(device=device)
    model.load_state_dict(read_dcp_model_state(step_dir, args), strict=True)
    return model.to(dtype), step_dir


def save_model_checkpoint(model: HybridLM, step_dir: str, dtype: torch.dtype = torch.float32) -> None:
    """Writes a model-only checkpoint from one process. Training can start from it with checkpoint.initial_load_path,
    and export and evaluation read it like any other. It is float32 by default; a teacher's may be 16-bit."""
    partial = step_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    dcp.save({"model": state}, checkpoint_id=partial, no_dist=True)
    with open(os.path.join(partial, MODEL_ARGS_FILE), "w") as f:
        json.dump(model_args_to_dict(model.args), f, indent=2)
    os.rename(partial, step_dir)


# ------------------------------------------------------------------------------------------------ training


def _plain(value: Any) -> Any:
    """The plain tensor inside a wrapper subclass.

    Float8 training wraps the local shard of each converted weight in torchao's WeightWithDynamicFloat8CastTensor, and
    the optimizer's moments of that weight follow it. Saved as they are, they would pickle torchao's classes into the
    checkpoint, which would then load only with torchao and never with weights_only. The plain tensor shares the
    wrapper's storage, so loading into it fills the wrapped weight."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not isinstance(local, torch.Tensor) or type(local) in (torch.Tensor, torch.nn.Parameter):
        return value
    inner = getattr(local, local.__tensor_flatten__()[0][0])
    if isinstance(value, DTensor):
        return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return inner


class _ModelState(Stateful):
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {key: _plain(value) for key, value in get_model_state_dict(self.model).items()}

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=True))


class _OptimizerState(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        state = get_optimizer_state_dict(self.model, self.optimizer,
                                         options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {key: _plain(value) for key, value in state.items()}

    def load_state_dict(self, sd):
        set_optimizer_state_dict(self.model, self.optimizer, sd,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Saves and restores the whole training state; resumes from the latest complete checkpoint."""

    def __init__(self, folder: str, *, model, optimizer, lr_scheduler, dataloader, train_state: Stateful,
                 dp_rank: int, dp_world_size: int, model_args: ModelArgs, job_config: dict, interval: int,
                 keep_latest_k: int = 0, async_mode: str = "disabled", enable: bool = True,
                 first_step: bool = False, exclude_from_loading: tuple[str, ...] = ()):
        self.folder, self.enable = folder, enable
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state = dataloader, train_state
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.model_args, self.job_config = model_args, job_config
        self.interval, self.keep_latest_k = interval, keep_latest_k
        self.async_mode = async_mode
        self.first_step, self.exclude_from_loading = first_step, set(exclude_from_loading)
        self._pending: _BackgroundSave | None = None
        self._async_pg = None
        if async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode must be disabled or async, got {async_mode!r}")
        if enable and async_mode == "async":
            # async saves run their collectives on a CPU group of their own, beside the training's group
            self._async_pg = dist.new_group(backend="gloo") if dist.is_initialized() else None

    # ---- what goes into a checkpoint
    def _states(self, dataloader_key: str) -> dict[str, Any]:
        return {
            "model": _ModelState(self.model),
            "optimizer": _OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "train_state": self.train_state,
            dataloader_key: self.dataloader,
            f"rng.dp_rank_{self.dp_rank}": _RNGState(),
        }

    def should_save(self, step: int, last: bool) -> bool:
        return self.enable and (last or step % self.interval == 0 or (self.first_step and step == 1))

    def save(self, step: int, model_only: bool = False) -> None:
        """Saves all the training state at ``step``. With ``model_only`` it saves only the model. Export and evaluation
        read such a checkpoint and a new run can start from it, but this run cannot continue from it."""
        if not self.enable:
            return
        self.wait()
        final = os.path.join(self.folder, f"step-{step}")
        partial = final + ".partial"
        if _rank() == 0:
            os.makedirs(self.folder, exist_ok=True)
            # this step's, and any other left by an interrupted save (no save of ours is in flight: waited above)
            for name in os.listdir(self.folder):
                if name.endswith(".partial"):
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        _barrier()
        t0 = time.monotonic()
        states = self._states(f"dataloader.dp_rank_{self.dp_rank}")
        if model_only:
            states = {"model": states["model"]}
        if self.async_mode != "disabled":
            future = dcp.async_save(states, checkpoint_id=partial, process_group=self._async_pg)
            logger.info(f"checkpoint step {step}: staged in {time.monotonic() - t0:.1f}s, writing in the background")
            complete = None
            if _rank() == 0:
                def complete():
                    self._complete(partial, final)
                    self._purge()
                    logger.info(f"checkpoint step {step}: saved to {final} in {time.monotonic() - t0:.1f}s")
            self._pending = _BackgroundSave(future, complete)
        else:
            dcp.save(states, checkpoint_id=partial)
            _barrier()
            if _rank() == 0:
                self._complete(partial, final)
            _barrier()
            if _rank() == 0:
                self._purge()
            logger.info(f"checkpoint step {step}: saved to {final} in {time.monotonic() - t0:.1f}s")

    def wait(self) -> None:
        """Waits for a background save, if one is running (it completes its step folder itself)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.join()

    def _complete(self, partial: str, final: str) -> None:
        """Run by rank 0 once every rank's part is written. Moves the step folder to its final name and names it in
        ``latest``."""
        with open(os.path.join(partial, MODEL_ARGS_FILE), "w") as f:
            json.dump(model_args_to_dict(self.model_args), f, indent=2)
        with open(os.path.join(partial, JOB_CONFIG_FILE), "w") as f:
            json.dump(self.job_config, f, indent=2, default=str)
        if os.path.exists(final):  # a re-save of the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(partial, final)
        tmp = os.path.join(self.folder, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(final) + "\n")
        os.replace(tmp, os.path.join(self.folder, "latest"))

    def _purge(self) -> None:
        """Deletes the checkpoints beyond keep_latest_k in a background thread. Deleting a large checkpoint can take
        longer than the other ranks should wait in a collective."""
        if self.keep_latest_k <= 0:
            return
        old = [os.path.join(self.folder, f"step-{s}") for s in complete_steps(self.folder)[:-self.keep_latest_k]]
        if old:
            self._join_purge()
            self._purge_thread = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in old],
                                                  daemon=True)
            self._purge_thread.start()

    def _join_purge(self) -> None:
        if getattr(self, "_purge_thread", None) is not None:
            self._purge_thread.join()
            self._purge_thread = None

    def latest_step(self) -> int | None:
        steps = complete_steps(self.folder)
        return steps[-1] if steps else None

    def load(self, step_dir: str, model_only: bool = False) -> None:
        """Restores a checkpoint into the live model, optimizer, schedule and loader, resharding as needed."""
        if model_only:
            dcp.load({"model": _ModelState(self.model)}, checkpoint_id=step_dir)
            return
        keys = set(dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata)
        if _only_the_model(keys):
            logger.warning(f"{step_dir} holds only the model: the optimizer, schedule and data start afresh")
            dcp.load({"model": _ModelState(self.model)}, checkpoint_id=step_dir)
            return
        saved_dp = sorted({int(m.group(1)) for k in keys if (m := re.match(r"dataloader\.dp_rank_(\d+)", k))})
        same_layout = len(saved_dp) == self.dp_world_size
        loader_rank = self.dp_rank if same_layout else 0
        states = self._states(f"dataloader.dp_rank_{loader_rank}")
        for part in self.exclude_from_loading:  # e.g. a fresh optimizer or data order on a loaded model
            states.pop(part if part != "dataloader" else f"dataloader.dp_rank_{loader_rank}")
        if not same_layout:
            states.pop(f"rng.dp_rank_{self.dp_rank}")
            logger.warning(f"resuming {len(saved_dp)} data-parallel ranks' checkpoint on {self.dp_world_size}: "
                           "model and optimizer are resharded; the data loaders restart from rank 0's position")
        dcp.load(states, checkpoint_id=step_dir)

    def close(self) -> None:
        self.wait()
        self._join_purge()


class _BackgroundSave:
    """A save written in the background and completed as soon as its write ends.

    DCP's save ends on every rank only after rank 0, the coordinator, has gathered all ranks' results and written the
    metadata. So rank 0 can rename the step folder at that point, in this thread, and a crash afterwards loses nothing.
    No collective runs outside the training's own order, because a rank that leaves on an error must not wait in a
    barrier the others never reach."""

    def __init__(self, future: Future, complete=None):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(future, complete), daemon=True,
                                       name="hybridtitan-checkpoint")
        self.thread.start()

    def _run(self, future: Future, complete) -> None:
        try:
            future.result()
            if complete is not None:
                complete()
        except BaseException as e:  # noqa: BLE001 -- raised on the training thread, in join()
            self.error = e

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class _RNGState(Stateful):
    """The RNG state of this rank (CPU, and the GPU's when there is one)."""

    def state_dict(self):
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, sd):
        torch.set_rng_state(sd["cpu"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"])
