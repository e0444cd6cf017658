"""The recipe's schema: every section and key the trainer reads, with its type, default and meaning.

A recipe (train_configs/*.toml) sets these and the command line overrides them (hybridtitan.config_manager reads both
into a JobConfig). The sections and the names, types and defaults of their keys are torchtitan 0.2.2's where
torchtitan has the key, so a torchtitan user's recipe reads the same; the keys of torchtitan's that hybridtitan
does not implement are listed in TITAN_OPTIONS and refused when set to anything but their default, rather than
silently ignored. Each field's docstring is its description in ``--help`` and docs/config-reference.md.

The sections are frozen: a JobConfig is decided once, by hybridtitan.config_manager (the recipe and the command
line) and preflight (what follows from them), and is a value after that.

(No ``from __future__ import annotations`` here: the field types must stay real types, the recipe checks read
them.)
"""

import dataclasses
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Literal

from hybridtitan.data.config import Data
from hybridtitan.models import GDNArgs, GQAArgs, KDAArgs, Mamba2Args, MLAArgs


def ruled(default, wanted: str, holds, **metadata):
    """A key's default with the range its value must be in, kept beside the key: ``holds(value)`` is checked for
    every recipe (config_manager.check_ranges), else "section.key must be WANTED, got VALUE"."""
    return field(default=default, metadata={"rule": (wanted, holds), **metadata})


def _positive(v):
    return math.isfinite(v) and v > 0


def _at_least(low, *, unset=False):
    return lambda v: (unset and v is None) or (v is not None and v >= low)


def _overrides_of(cls, doc: str):
    """A dataclass with the fields of ``cls``, each optional (None: keep the flavor's value)."""
    hints = typing.get_type_hints(cls)
    made = dataclasses.make_dataclass(
        cls.__name__.replace("Args", "Overrides"),
        [(f.name, hints[f.name] | None, field(default=None)) for f in fields(cls)],
        frozen=True,
    )
    made.__doc__ = doc
    return made


GDNOverrides = _overrides_of(GDNArgs, "Gated DeltaNet sizes; unset keys keep the flavor's")
KDAOverrides = _overrides_of(KDAArgs, "Kimi Delta Attention sizes; unset keys keep the flavor's")
Mamba2Overrides = _overrides_of(Mamba2Args, "Mamba2 sizes; unset keys keep the flavor's")
MLAOverrides = _overrides_of(MLAArgs, "Multi-latent attention sizes and RoPE/YaRN; unset keys keep the flavor's")
GQAOverrides = _overrides_of(GQAArgs, "Grouped-query attention sizes and RoPE; unset keys keep the flavor's")


@dataclass(frozen=True)
class Job:
    config_file: str | None = None
    """File to read job configs from"""

    dump_folder: str = "./outputs"
    """Folder to dump job outputs"""

    description: str = "default job"
    """Description of the job"""

    print_config: bool = False
    """Print the job configs to terminal"""


@dataclass(frozen=True)
class Profiling:
    enable_profiling: bool = False
    """Whether to enable pytorch profile"""

    save_traces_folder: str = "profile_traces"
    """Trace files location"""

    profile_freq: int = 10
    """How often to collect profile traces, in iterations"""

    profiler_active: int = 1
    """The steps profiler is active for.

    This is used to configure torch.profile.schedule."""

    profiler_warmup: int = 3
    """The number of warmup steps before the active step in each profiling cycle.

    This is used to configure torch.profile.schedule."""


@dataclass(frozen=True)
class Metrics:
    log_freq: int = ruled(10, "positive", _positive)
    """Log loss, grad norm, lr, tokens/s, MFU and memory every N steps (console, dump_folder/metrics.jsonl,
    TensorBoard)"""

    enable_tensorboard: bool = False
    """Whether to log metrics to TensorBoard"""

    save_tb_folder: str = "tb"
    """Folder to dump TensorBoard states"""

    enable_wandb: bool = False
    """Also log to Weights & Biases (pip install wandb)"""


@dataclass(frozen=True)
class Model:
    name: str = ruled("hybrid", "'hybrid'", lambda v: v == "hybrid")
    """Model family (only 'hybrid')"""

    flavor: str = "debug_hybrid"
    """Named configuration (python -m hybridtitan.describe --list), the keys below overriding it; 'checkpoint': the
    model checkpoint.initial_load_path holds (upcycle's output), the keys below only checked against it"""

    pattern: str | None = None
    """Sublayer pattern: '*' MLA attention, 'M' mixer, '-' SwiGLU MLP, e.g. '*-M-M-M-*-M-M-M-*-M-M-M-'"""

    hybrid_attention_ratio: float | None = None
    """Without an explicit pattern: fraction of (mixer, MLP) pairs that become (attention, MLP) (Primus rule)"""

    mixer: str | None = None
    """The 'M' sublayer: gdn, kda or mamba2"""

    attention: str | None = None
    """The '*' sublayer: mla (multi-latent attention) or gqa (grouped-query attention, Llama's)"""

    n_layers: int | None = None
    """Number of sublayers (the pattern's length)"""

    dim: int | None = None
    """Hidden size"""

    ffn_dim: int | None = None
    """SwiGLU hidden size"""

    vocab_size: int | None = None
    """Vocabulary size (at least the tokenizer's)"""

    tie_embeddings: bool | None = None
    """Share the embedding and the output layer"""

    norm_eps: float | None = None
    """RMSNorm epsilon"""

    init_std: float | None = None
    """Standard deviation of the normal initialisation"""

    converters: list[str] = field(default_factory=list)
    """Model converters applied before parallelization: 'quantize.linear.float8' (float8 training of the linear
    layers with torchao, configured in [quantize.linear.float8]; docs/float8.md)"""

    gdn: GDNOverrides = field(default_factory=GDNOverrides)

    kda: KDAOverrides = field(default_factory=KDAOverrides)

    mamba2: Mamba2Overrides = field(default_factory=Mamba2Overrides)

    mla: MLAOverrides = field(default_factory=MLAOverrides)

    gqa: GQAOverrides = field(default_factory=GQAOverrides)


@dataclass(frozen=True)
class Optimizer:
    name: Literal['AdamW', 'Adam'] = "AdamW"
    """Weight decay applies to weight matrices only"""

    lr: float = ruled(0.0008, "a positive number", _positive)
    """Learning rate to use"""

    beta1: float = ruled(0.9, "in [0, 1)", lambda v: 0 <= v < 1)

    beta2: float = ruled(0.95, "in [0, 1)", lambda v: 0 <= v < 1)
    """Exponential moving average hyperparameters to use"""

    eps: float = ruled(1e-08, "a positive number", _positive)
    """Epsilon value to use"""

    weight_decay: float = ruled(0.1, "0 or more", lambda v: math.isfinite(v) and v >= 0)
    """Weight decay to use"""

    implementation: Literal['for-loop', 'foreach', 'fused'] = "fused"
    """torch's Adam/AdamW kernels: fused (CPUs and GPUs), foreach or for-loop; the update runs on each rank's shards
    of the parameters"""


@dataclass(frozen=True)
class LRScheduler:
    warmup_steps: int = ruled(200, "0 or more", _at_least(0))
    """Steps of the linear warmup to optimizer.lr"""

    total_steps: int | None = ruled(None, "1 or more (or unset)", _at_least(1, unset=True))
    """The schedule's length in steps (unset: training.steps): a shorter run on the same curve"""

    decay_ratio: float | None = ruled(None, "in [0, 1] (or unset)", lambda v: v is None or 0 <= v <= 1)
    """The share of the schedule's steps that decay the rate, at its end (warmup-stable-decay, arXiv 2404.06395);
    unset: the decay starts at the end of the warmup"""

    decay_type: Literal['linear', 'sqrt', 'cosine'] = "linear"
    """The decay's curve from the peak rate to optimizer.lr x min_lr_factor: linear, sqrt (1 - sqrt of the decay's
    progress) or cosine"""

    min_lr_factor: float = ruled(0.0, "in [0, 1]", lambda v: 0 <= v <= 1)
    """Min lr ratio for lr scheduler. If provided, the range of decay factor is scaled from 1 to `min_lr_factor` to
    ensure the learning rate does not drop below `optimizer.lr * lr_scheduler.min_lr_factor`."""


@dataclass(frozen=True)
class Training:
    local_batch_size: int = ruled(8, "positive", _positive)
    """Local batch size (i.e., per-device batch size)"""

    global_batch_size: int = ruled(-1, "positive (or -1: local x data-parallel)", lambda v: v == -1 or v > 0)
    """Global batch size (defaults to `training.local_batch_size * data-parallel degree`)"""

    seq_len: int = ruled(2048, "positive", _positive)
    """Sequence length"""

    max_norm: float | int = ruled(1.0, "a positive number", _positive)
    """Max norm for gradient clipping"""

    steps: int = ruled(10000, "positive", _positive)
    """How many train steps to run"""

    mixed_precision_param: Literal['bfloat16', 'float32'] = "bfloat16"
    """GPUs: the dtype FSDP2 gathers parameters in and computes with (master weights stay float32). CPUs always
    compute in float32"""

    mixed_precision_reduce: Literal['float32'] = "float32"
    """The dtype of FSDP2's gradient reductions"""

    gc_freq: int = ruled(50, "1 or more", _at_least(1))
    """Python garbage control scheduling interval, in steps"""

    expandable_segments: bool = True
    """GPU: the CUDA/HIP caching allocator uses expandable segments (less fragmentation); set by the trainer"""

    loss_chunk_size: int = ruled(4096, "positive", _positive)
    """Tokens per chunk of the fused linear cross-entropy (its extra memory is one chunk of logits)"""

    eod_mask_loss: bool = False
    """No loss where the input token is the end-of-document token (Megatron's eod_mask_loss: the first token of the
    next document is not predicted from the last one's EOD). The loss is the mean over the counted tokens of the
    whole global batch, however it is split into micro-batches and ranks"""

    gdn_backend: Literal['triton', 'flash_qla'] = "triton"
    """GPU: FLA's backend for the gated delta rule: triton (FLA's Triton kernels, on every GPU, whatever else is
    installed) or flash_qla (FlashQLA where the package is installed and takes the call, FLA's Triton kernels
    otherwise; the log says which ran)"""

    cuda_graphs: bool = False
    """GPU: replay the recurrent mixers' FLA calls from CUDA graphs captured in the first step (whole sequences; packed
    documents run eagerly). Much less host time per step for more memory (each layer keeps its own inputs, outputs
    and input gradients): for small micro-batches, where the host's kernel launches set the pace"""

    kernel_configs: str = ruled("shipped", "shipped, autotune or a folder's path", lambda v: bool(v.strip()),
                                type_text="shipped, autotune or a folder")
    """GPU: where FLA's Triton kernels (and ours) take their tuned configurations from: shipped (the package's,
    hybridtitan/kernel_configs/<GPU>/, where they match this GPU and its Triton and FLA versions; otherwise FLA
    autotunes), autotune (FLA autotunes each kernel at each new shape, in every process), or the path of a folder
    that python -m hybridtitan.tune recorded (refused if it is another GPU's or other versions'). The log says which"""


@dataclass(frozen=True)
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Groups of ranks that each hold a whole copy of the sharded state (HSDP with data_parallel_shard_degree > 1,
    e.g. the nodes); 1: none"""

    data_parallel_shard_degree: int = -1
    """Ranks that FSDP2 shards the parameters, gradients and optimizer state over; -1: all the ranks the other
    degrees leave"""

    fsdp_reshard_after_forward: Literal['default', 'always', 'never'] = "default"
    """Whether a sublayer frees its gathered parameters after its forward (less memory, a second all-gather in the
    backward): always, never, or default (every sublayer but the last, and nothing over a shard degree of 1)"""

    context_parallel_degree: int = ruled(1, "1 or more", _at_least(1))
    """Context parallelism degree: each training sequence split over this many consecutive ranks, which hold the
    same batch (data parallel = ranks / degree; FSDP shards over all ranks). seq_len (and validation.seq_len) must
    divide by 2 x degree. 1 means disabled. docs/context-parallel.md says what runs where"""

    context_parallel_load_balancer: str | None = "headtail"
    """How a sequence is cut over the context-parallel ranks, in 2 x degree chunks: "headtail" (rank r holds chunks
    r and 2 x degree - 1 - r, an early and a late one: causal attention's work balanced) or None (none on the
    command line, "none" in TOML: rank r holds one contiguous slice)"""


@dataclass(frozen=True)
class Checkpoint:
    enable: bool = False
    """Whether to enable checkpoint"""

    folder: str = "checkpoint"
    """The folder to store the checkpoints. When enable is set to true, checkpoints will be in
    {--job.dump_folder}/{--checkpoint.folder}."""

    interval: int = ruled(500, "positive", _positive)
    """Steps between checkpoints"""

    initial_load_path: str | None = None
    """A step folder (e.g. OTHER_RUN/checkpoint/step-1000, or an import_hf output) or a checkpoint folder (its newest
    step) to start from, when this run's own checkpoint folder holds none; with one there, the run resumes from it
    and this is ignored (said in the log)"""

    initial_load_model_only: bool = True
    """From initial_load_path, the weights alone; false: its optimizer, schedule, data order and step too, as a
    resume"""

    last_save_model_only: bool = False
    """Save only the model at the last step (smaller; the run cannot be extended from it). Off: the last checkpoint is
    a full one, like every other"""

    async_mode: Literal['disabled', 'async'] = "disabled"
    """async: checkpoints are written in the background while training goes on"""

    keep_latest_k: int = ruled(10, "0 (keep all) or more", _at_least(0))
    """Keep only the newest K checkpoints (0: keep all)"""

    load_step: int = -1
    """The step of the run's own checkpoint folder to resume from; -1: its latest complete one"""

    exclude_from_loading: list[str] = field(default_factory=lambda: [])
    """Parts of a checkpoint not loaded (optimizer, lr_scheduler, dataloader, train_state): each starts afresh"""

    enable_first_step_checkpoint: bool = False
    """A checkpoint after the first step too: saving checked at once on a new cluster or storage"""

    allow_tokenizer_change: bool = False
    """Start from a checkpoint trained with another tokenizer than data.tokenizer (refused otherwise: the same ids
    would mean other tokens); for a deliberate change of vocabulary"""


@dataclass(frozen=True)
class ActivationCheckpoint:
    mode: Literal['none', 'selective', 'full'] = "selective"
    """none; selective: every N-th sublayer (N = selective_ac_option); full: every sublayer is recomputed in the
    backward pass"""

    selective_ac_option: str = field(default="2", metadata={"type_text": "N"})
    """selective mode: checkpoint every N-th sublayer (an integer >= 1)"""


@dataclass(frozen=True)
class Compile:
    enable: bool = False
    """torch.compile the parts named in compile.components"""

    components: list[Literal['model', 'loss', 'norm', 'swiglu']] = field(default_factory=lambda: ["model", "loss"])
    """model: each sublayer; loss: the elementwise part of each cross-entropy chunk; norm: each RMSNorm with the
    residual add before it; swiglu: the MLPs' elementwise passes"""


@dataclass(frozen=True)
class Comm:
    backend: Literal["auto", "gloo"] = "auto"
    """The collectives' backend: auto (NCCL on NVIDIA GPUs, RCCL on ROCm, gloo on CPUs) or gloo, which carries GPU
    tensors through the host and so lets several ranks share one GPU (a check of context parallelism on a
    one-GPU machine; slow)"""

    init_timeout_seconds: int = 300
    """Seconds a collective may wait before the run fails, until the first step is done (start-up, compilation,
    autotuning)"""

    train_timeout_seconds: int = 100
    """Seconds a collective may wait after the first step: a rank that stops answering (a hang) ends every rank
    within it, with one error line"""


def _held_out() -> Data:
    return Data(path="", shuffle=False)


@dataclass(frozen=True)
class Validation:
    enable: bool = False
    """Compute the loss on a held-out set every validation.freq steps and at the end (console, metrics.jsonl,
    TensorBoard, W&B); it changes nothing of the training"""

    local_batch_size: int | None = ruled(None, "1 or more (or unset)", _at_least(1, unset=True))
    """Sequences per rank in a validation batch (None: training.local_batch_size)"""

    seq_len: int | None = ruled(None, "1 or more (or unset)", _at_least(1, unset=True))
    """Tokens per validation sequence (None: training.seq_len)"""

    freq: int = ruled(500, "1 or more", _at_least(1))
    """Steps between validations"""

    steps: int = ruled(-1, "1 or more (or -1: one pass)", lambda v: v == -1 or v >= 1)
    """Batches per rank in each validation (the same batches every time); -1: one pass over the set"""

    data: Data = field(default_factory=_held_out)
    """The held-out set: any data source, as [data] (its tokenizer is the training data's; never shuffled)"""


@dataclass(frozen=True)
class Debug:
    seed: int | None = ruled(None, "in [0, 2**32) (or unset)", lambda v: v is None or 0 <= v < 2**32)
    """Base seed of the initial weights, the data order and the RNGs (None: 42)"""

    deterministic: bool = False
    """Use deterministic algorithms wherever possible, may be slower"""


# [data]: Data (ours)


# [eval]: Eval (ours)


# [distill]: Distill (ours)


# [dpo]: Dpo (ours)


@dataclass(frozen=True)
class Eval:
    tasks: list[str] = field(default_factory=list)
    """lm-eval tasks (names, or paths of local task YAMLs) evaluated on the live model during training, by all
    ranks, each on its share of the requests; results logged as eval/<task>/<metric>. Empty: none"""

    every_checkpoints: int = ruled(1, "1 or more", _at_least(1))
    """Evaluate after every N-th checkpoint saved, and at the end"""

    include_path: str = ""
    """A folder of extra task YAMLs (as lm-eval's --include_path)"""

    limit: float | None = ruled(None, "positive (or unset)", lambda v: v is None or v > 0)
    """Examples per task (a fraction if below 1; None: all)"""

    num_fewshot: int | None = None
    """Few-shot examples per request (None: the task's default)"""

    batch_size: int = ruled(8, "1 or more", _at_least(1))
    """Requests per forward pass"""


@dataclass(frozen=True)
class Distill:
    teacher: str = ""
    """The frozen teacher: a Hugging Face folder (a Llama, say) or a hybridtitan checkpoint (step, checkpoint or
    dump folder), of the student's vocabulary and tokenizer. Empty: no distillation, the cross-entropy alone"""

    kl_weight: float = ruled(1.0, "0 or more", lambda v: math.isfinite(v) and v >= 0)
    """Weight of the KL divergence of the student's next-token distributions from the teacher's (times T^2)"""

    ce_weight: float = ruled(0.0, "0 or more", lambda v: math.isfinite(v) and v >= 0)
    """Weight of the student's cross-entropy on the data"""

    layer_weight: float = ruled(0.0, "0 or more", lambda v: math.isfinite(v) and v >= 0)
    """Weight of layer distillation: per block (a token-mixing sublayer and the MLPs after it), fed the teacher's
    stream, the L2 distance of its output and of its mixing sublayer's output from the teacher's (Zebra-Llama's
    ILD); the teacher and student must have the same sublayer structure"""

    temperature: float = ruled(1.0, "positive", lambda v: v > 0)
    """Softmax temperature T of the KL"""

    chunk_size: int = ruled(4096, "1 or more", _at_least(1))
    """Tokens per chunk of the KL: both models' 16-bit logits of a chunk are its extra memory on GPUs (about five
    float32 chunks more where it runs eagerly: CPUs, a temperature with the cross-entropy)"""

    kernel: Literal["hybridtitan", "fla"] = "hybridtitan"
    """GPU: the KL's kernel: hybridtitan's (the chunks above, each one's softmax in a Triton kernel) or FLA's fused
    KL (temperature 1 only; its own chunks; its output-weight gradient accumulates in float32 GEMMs)"""


@dataclass(frozen=True)
class Dpo:
    path: str = ""
    """Preference pairs (prompt, chosen, rejected): local .jsonl/.json/.parquet files (a file or a glob), a folder or a
    Hugging Face dataset name. Set: the run is DPO (docs/dpo.md), each pair at most training.seq_len tokens, prompt and
    response; empty: no DPO"""

    name: str = ""
    """The dataset's config name, where it has several"""

    split: str = "train"
    """The split of the training pairs (local files are the split)"""

    validation_path: str = ""
    """With validation.enable: the held-out pairs, as dpo.path (empty: dpo.path itself, its validation_split)"""

    validation_split: str = "test"
    """The split of the held-out pairs"""

    prompt_field: str = "prompt"
    """The column of the prompt: a text (the user's turn) or a list of {role, content} messages"""

    chosen_field: str = "chosen"
    """The column of the preferred response: a text, or a list of messages whose last is the response (the messages
    before it, where there are any, are then the prompt)"""

    rejected_field: str = "rejected"
    """The column of the dispreferred response, as chosen_field"""

    chat_template: str = "zebra"
    """The template that renders prompt and response: zebra (Zebra-Llama's, hybridtitan/assets/chat_templates/),
    tokenizer (the tokenizer's own), a .jinja file, or none (the texts as they are, an EOS after the response)"""

    reference: str = ""
    """The frozen reference model (sharded like a distillation teacher): a model folder of the student's vocabulary
    and tokenizer. Empty: the checkpoint the stage starts from (the run's own step-0, else
    checkpoint.initial_load_path)"""

    beta: float = ruled(0.1, "positive", lambda v: math.isfinite(v) and v > 0)
    """The DPO temperature beta: loss = -log sigmoid(beta x ((pi_c - ref_c) - (pi_r - ref_r))), over the responses'
    summed log-probabilities"""


@dataclass(frozen=True)
class Float8:
    enable_fsdp_float8_all_gather: bool = False
    """Whether to enable float8 all-gather in FSDP, recommended for tensorwise scaling"""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Whether to precompute float8 scales dynamically for FSDP, recommended for tensorwise scaling"""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """If specified, creates float8 config from recipe name"""

    filter_fqns: list[str] = field(default_factory=list)
    """Comma-separated module names (substrings of the names) kept in high precision; the output layer, gates and
    GEMMs too small to gain always are"""

    emulate: bool = False
    """Float8 numerics in float32 matrix products instead of float8 hardware: for tests on CPUs or GPUs below
    compute capability 8.9; not with torch.compile of the model"""


@dataclass(frozen=True)
class QuantizedLinear:
    float8: Float8 = field(default_factory=Float8)


@dataclass(frozen=True)
class Quantize:
    linear: QuantizedLinear = field(default_factory=QuantizedLinear)


@dataclass(frozen=True)
class JobConfig:
    """A whole recipe: its sections in the order --help and the reference list them."""

    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    data: Data = field(default_factory=Data)
    eval: Eval = field(default_factory=Eval)
    distill: Distill = field(default_factory=Distill)
    dpo: Dpo = field(default_factory=Dpo)
    quantize: Quantize = field(default_factory=Quantize)


# torchtitan 0.2.2's keys that hybridtitan does not implement, with their type and default: a recipe or command
# line that sets one to another value is refused (config.check_titan_option), its default is accepted and ignored.
TITAN_OPTIONS: dict[str, tuple[typing.Any, typing.Any]] = {
    "job.save_config_file": (str | None, None),
    "job.custom_config_module": (str, ""),
    "profiling.enable_memory_snapshot": (bool, False),
    "profiling.save_memory_snapshot_folder": (str, "memory_snapshot"),
    "metrics.disable_color_printing": (bool, False),
    "metrics.save_for_all_ranks": (bool, False),
    "model.hf_assets_path": (str, "./tests/assets/tokenizer"),
    "model.tokenizer_path": (str | None, None),
    "model.print_after_conversion": (bool, False),
    "optimizer.early_step_in_backward": (bool, False),
    "training.dataset": (str, "c4_test"),
    "training.dataset_path": (str | None, None),
    "training.enable_cpu_offload": (bool, False),
    "training.dtype": (Literal["bfloat16", "float32"], "float32"),
    "training.gc_debug": (bool, False),
    "training.dataloader.num_workers": (int, 0),
    "training.dataloader.persistent_workers": (bool, False),
    "training.dataloader.pin_memory": (bool, False),
    "training.dataloader.prefetch_factor": (int | None, None),
    "parallelism.tensor_parallel_degree": (int, 1),
    "parallelism.disable_loss_parallel": (bool, False),
    "parallelism.enable_async_tensor_parallel": (bool, False),
    "parallelism.pipeline_parallel_degree": (int, 1),
    "parallelism.module_fqns_per_model_part": (list[list[str]] | None, None),
    "parallelism.pipeline_parallel_first_stage_less_layers": (int, 1),
    "parallelism.pipeline_parallel_last_stage_less_layers": (int, 1),
    "parallelism.pipeline_parallel_layers_per_stage": (int | None, None),
    "parallelism.pipeline_parallel_schedule": (str, "1F1B"),
    "parallelism.pipeline_parallel_schedule_csv": (str | None, ""),
    "parallelism.pipeline_parallel_microbatch_size": (int, 1),
    "parallelism.pipeline_parallel_expert_parallel_overlap": (bool, True),
    "parallelism.context_parallel_rotate_method": (Literal["allgather", "alltoall"], "allgather"),
    "parallelism.expert_parallel_degree": (int, 1),
    "parallelism.expert_tensor_parallel_degree": (int, 1),
    "parallelism.expert_parallel_comm_backend": (Literal["standard", "deepep"], "standard"),
    "checkpoint.enable_ft_dataloader_checkpoints": (bool, True),
    "checkpoint.initial_load_in_hf": (bool, False),
    "checkpoint.initial_load_in_hf_quantized": (bool, False),
    "checkpoint.last_save_in_hf": (bool, False),
    "checkpoint.export_dtype": (Literal["float16", "bfloat16", "float32"], "float32"),
    "checkpoint.create_seed_checkpoint": (bool, False),
    "checkpoint.load_only": (bool, False),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": (list[str], ["moe.router.gate"]),
    "activation_checkpoint.early_stop": (bool, False),
    "activation_checkpoint.memory_budget": (float, 0.5),
    "activation_checkpoint.visualize_memory_budget_pareto": (bool, False),
    "activation_checkpoint.preserve_rng_state": (bool, True),
    "activation_checkpoint.determinism_check": (str, "default"),
    "activation_checkpoint.debug": (bool, False),
    "compile.backend": (str, "inductor"),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": (Literal["triton", "cuda", "torch"], "triton"),
    "quantize.linear.mx.recipe_name": (str, "mxfp8_cublas"),
    "quantize.linear.mx.filter_fqns": (list[str], ["output"]),
    "quantize.grouped_mm.float8.fqns": (list[str] | str, []),
    "quantize.grouped_mm.mx.recipe_name": (Literal["mxfp8"], "mxfp8"),
    "quantize.grouped_mm.mx.fqns": (list[str] | str, []),
    "comm.trace_buf_size": (int, 20000),
    "comm.save_traces_folder": (str, "comm_traces"),
    "comm.save_traces_file_prefix": (str, "rank_"),
    "comm.mode": (Literal["default", "fake_backend", "local_tensor"], "default"),
    "memory_estimation.enable": (bool, False),
    "memory_estimation.disable_fake_mode": (bool, False),
    "fault_tolerance.enable": (bool, False),
    "fault_tolerance.process_group": (str, "gloo"),
    "fault_tolerance.process_group_timeout_ms": (int, 10000),
    "fault_tolerance.replica_id": (int, 0),
    "fault_tolerance.group_size": (int, 0),
    "fault_tolerance.min_replica_size": (int, 1),
    "fault_tolerance.semi_sync_method": (str | None, None),
    "experimental.custom_import": (str, ""),
    "experimental.custom_args_module": (str, ""),
    "validation.dataset": (str, "c4_validation"),
    "validation.dataset_path": (str | None, None),
    "validation.dataloader.num_workers": (int, 0),
    "validation.dataloader.persistent_workers": (bool, False),
    "validation.dataloader.pin_memory": (bool, False),
    "validation.dataloader.prefetch_factor": (int | None, None),
    "debug.deterministic_warn_only": (bool, False),
    "debug.moe_force_load_balance": (bool, False),
}
# whole torchtitan sections hybridtitan does not implement (their keys are in TITAN_OPTIONS)
TITAN_SECTIONS = ("memory_estimation", "fault_tolerance", "experimental")
