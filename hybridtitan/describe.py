"""What a recipe builds, without building it on a device.

    python -m hybridtitan.describe --job.config_file train_configs/X.toml [--model.flavor F] [--json]
    python -m hybridtitan.describe --list
    python -m hybridtitan.describe --config-reference      # docs/config-reference.md: every key, its default

It prints the layer plan, the parameters (total and non-embedding), the training FLOPs per token counted per sublayer,
and a memory estimate per device for the configured batch. ``--json`` prints one JSON object instead."""

from __future__ import annotations

import dataclasses
import json
import sys

from hybridtitan.cli import one_line_errors
from hybridtitan.config_manager import (
    ConfigError,
    compiles,
    config_reference,
    model_args,
    parse_config,
    selective_ac_interval,
)
from hybridtitan.float8 import CONVERTER as FLOAT8
from hybridtitan.float8 import float8_settings, plan_float8
from hybridtitan.job_config import JobConfig
from hybridtitan.models import FLAVORS, build_model
from hybridtitan.models.flops import (
    flops_per_token,
    mamba2_conv_channels,
    param_counts,
    sublayer_flops,
    sublayer_params,
)
from hybridtitan.parallel import reshard_after_forward_for

GIB = 2**30


def activation_elements_per_token(args, kind: str) -> int:
    """A rough count, per token, of the activations a sublayer keeps for its backward. It counts the inputs of every
    matrix product and nonlinearity, and the residual stream. The recurrent kernels keep about their inputs."""
    d = args.dim
    if kind == "mlp":  # gate and up; silu(gate) * up is formed again in the backward (ops.swiglu_linear)
        return 2 * d + 2 * args.ffn_dim
    if kind == "attention" and args.attention == "gqa":  # q, k, v before and after RoPE, the attention output
        g = args.gqa
        return 2 * d + 2 * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim + g.num_heads * g.head_dim
    if kind == "attention":
        a = args.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        return 2 * d + 2 * a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim + \
            a.num_heads * (2 * qk + 2 * (a.qk_nope_head_dim + a.v_head_dim) + 2 * a.v_head_dim)
    if args.mixer in ("gdn", "kda"):
        g = getattr(args, args.mixer)
        v_heads = g.num_v_heads if args.mixer == "gdn" else g.num_heads
        kd, vd = g.num_heads * g.head_dim, v_heads * g.head_v_dim
        gate = v_heads if args.mixer == "gdn" else kd
        return 2 * d + 2 * (2 * kd + vd) + 2 * gate + 4 * vd
    inner = d * args.mamba2.expand
    conv = mamba2_conv_channels(args)
    return 2 * d + (2 * inner + conv) + conv + 3 * inner


def teacher_estimate(cfg: JobConfig, args, tokens: int, param_bytes: int) -> dict:
    """What a distillation teacher ([distill]) adds to a device's memory, and the step's FLOPs with it. Returns {}
    without a teacher.

    The estimate counts:

    * its 16-bit parameters, sharded (each module frees what it gathered after its forward);
    * the copy of its output weight, and its final hidden states, which the KL reads;
    * the activations of one MLP of its forward at a time;
    * its residual stream at every sublayer, for layer distillation;
    * the KL's chunks in place of the cross-entropy's. On GPUs these are both models' 16-bit logits of
      distill.chunk_size tokens. FLA's kernel instead holds logits of up to an eighth of the tokens, and the float32
      gradient of the output weight. Where the KL runs eagerly, there are five float32 chunks more."""
    d = cfg.distill
    if cfg.dpo.path:  # DPO's reference model and second rows are not estimated: the line says so
        return {"assumes": "; DPO's frozen reference (dpo.reference) is left out, and so is the second row of each "
                           "pair (a micro-batch of training.local_batch_size pairs is twice as many rows)"}
    if not d.teacher:
        return {}
    from hybridtitan.distill import Teacher, training_flops_per_token
    from hybridtitan.model_folder import read_folder

    try:
        t = read_folder(d.teacher).args
    except Exception as e:  # noqa: BLE001 -- a folder not here (describe plans a run elsewhere): said, not fatal
        return {"assumes": f"; the teacher {d.teacher} is left out (it cannot be read here: {e})"}
    shard = max(cfg.parallelism.data_parallel_shard_degree, 1)
    counts = param_counts(t)
    total = counts["total"] * param_bytes / shard + (counts["embedding"] + counts["output_layer"]) * param_bytes
    total += t.vocab_size * t.dim * param_bytes + tokens * t.dim * param_bytes + tokens * 2 * t.ffn_dim * param_bytes
    if d.layer_weight:
        total += (t.n_layers + 1) * tokens * t.dim * param_bytes
    loss_bytes = None
    if d.kl_weight or d.ce_weight:
        if param_bytes == 2 and d.kernel == "fla" and d.temperature == 1:
            groups = min(8, -(-t.vocab_size // args.dim))
            rows = min(1 << (-(-tokens // groups) - 1).bit_length(), tokens)
            loss_bytes = 2 * rows * t.vocab_size * param_bytes + args.vocab_size * args.dim * 4
        else:
            chunk = min(tokens, d.chunk_size)
            eager = param_bytes != 2 or (d.ce_weight and d.temperature != 1)
            loss_bytes = chunk * t.vocab_size * (2 * param_bytes + (5 * 4 if eager else 0))
    # host memory of a rank while it reads the teacher (model_loader.load_into_shards): its shard, plus one stored
    # tensor held twice (DCP's reader holds its bytes and the tensor made of them), the largest being the embedding
    host = counts["total"] * param_bytes / shard + 2 * t.vocab_size * t.dim * param_bytes
    return {"bytes": total, "loss_bytes": loss_bytes, "host_bytes": host, "whole_bytes": counts["total"] * param_bytes,
            "flops_per_token": training_flops_per_token(args, cfg.training.seq_len, d, Teacher(d.teacher, t)),
            "assumes": f"; the teacher {t.pattern} ({counts['total']:,} parameters, {8 * param_bytes}-bit) sharded "
                       f"over {shard} rank(s), its forward's FLOPs counted"}


def cp_note(seq_len: int, cp: int) -> str:
    if cp == 1:
        return ""
    return (f"; context parallel {cp}: {seq_len // cp} tokens of each row a rank, the attention keys it gathers "
            "from the others not counted")


def describe(cfg: JobConfig) -> dict:
    args = model_args(cfg)
    t = cfg.training
    counts = param_counts(args)
    flops = flops_per_token(args, t.seq_len)
    on_gpu_bytes = 2 if t.mixed_precision_param == "bfloat16" else 4
    cp = cfg.parallelism.context_parallel_degree
    shard = max(cfg.parallelism.data_parallel_shard_degree, 1) * cp  # FSDP shards over the context ranks too
    tokens = t.local_batch_size * t.seq_len // cp  # a context-parallel rank holds seq_len / cp tokens of a row
    ac = cfg.activation_checkpoint.mode
    every = selective_ac_interval(cfg)
    act = 0
    for i, kind in enumerate(args.kinds):
        kept = ac == "none" or (ac == "selective" and i % every != 0)
        act += activation_elements_per_token(args, kind) if kept else args.dim
    act_bytes = act * tokens * on_gpu_bytes + tokens * args.dim * 4
    # one chunk of 16-bit logits. On GPUs (16-bit runs) our kernel writes their gradient over them. Compiled, the
    # gradient is a second chunk. Eagerly there is also a float32 copy.
    if compiles(cfg, "loss"):
        loss_chunk_bytes = 4
    else:
        loss_chunk_bytes = 2 if on_gpu_bytes == 2 else 8
    loss_bytes = min(tokens, t.loss_chunk_size) * args.vocab_size * loss_chunk_bytes
    # fp32 parameters, gradients and two AdamW moments, sharded. Where nothing reshards after the forward pass
    # (one shard with the default policy, or "never"), add the gathered 16-bit copy of every parameter.
    kept_gathered = not reshard_after_forward_for(cfg.parallelism.fsdp_reshard_after_forward, 0, args.n_layers, shard)
    unknown_degree = cfg.parallelism.data_parallel_shard_degree == -1
    states = counts["total"] * 16 / shard + (counts["total"] * on_gpu_bytes if kept_gathered else 0)
    teacher = teacher_estimate(cfg, args, tokens, on_gpu_bytes)
    if teacher.get("loss_bytes") is not None:  # the distillation's head replaces the cross-entropy's
        loss_bytes = teacher["loss_bytes"]
    if teacher.get("flops_per_token"):
        flops = {**flops, "total": teacher["flops_per_token"]}
    float8 = None
    if FLOAT8 in cfg.model.converters:  # which linears a float8 run converts (checked on the GPU at the start)
        conversion = plan_float8(build_model(args, "meta"), float8_settings(cfg), fsdp_sharded=shard > 1)
        float8 = {"recipe": conversion.recipe, "converted": conversion.converted, "kept": conversion.kept,
                  "flops_share": conversion.flops_share, "summary": conversion.summary()}
    layers = [
        {"index": i, "kind": kind, "symbol": args.pattern[i],
         "params": sum(sublayer_params(args, kind).values()), "flops_per_token": sublayer_flops(args, kind, t.seq_len)}
        for i, kind in enumerate(args.kinds)
    ]
    return {
        "flavor": cfg.model.flavor, "mixer": args.mixer, "pattern": args.pattern, "n_layers": args.n_layers,
        "dim": args.dim, "vocab_size": args.vocab_size, "tie_embeddings": args.tie_embeddings,
        "params_total": counts["total"], "params_non_embedding": counts["non_embedding"],
        "params_embedding": counts["embedding"], "flops_per_token": flops["total"],
        "flops_per_token_output_layer": flops["output_layer"], "seq_len": t.seq_len,
        "local_batch_size": t.local_batch_size, "layers": layers, "float8": float8,
        "memory_estimate_gib": {
            "params_grads_optimizer": states / GIB, "activations": act_bytes / GIB, "loss_chunk": loss_bytes / GIB,
            "teacher": teacher.get("bytes", 0) / GIB,
            "teacher_host_while_loading": teacher.get("host_bytes", 0) / GIB,
            "teacher_whole": teacher.get("whole_bytes", 0) / GIB,
            "total": (states + act_bytes + loss_bytes + teacher.get("bytes", 0)) / GIB,
            "assumes": f"fp32 master weights, gradients and AdamW moments sharded over {shard} rank(s)"
                       f"{' (data_parallel_shard_degree -1 is counted as 1 here)' if unknown_degree else ''}"
                       f"{', the gathered parameters kept from forward to backward' if kept_gathered else ''}; "
                       f"{8 * on_gpu_bytes}-bit activations, activation checkpointing '{ac}'"
                       f"{cp_note(t.seq_len, cp)}"
                       f"{teacher['assumes'] if teacher else ''}",
        },
    }


def _print_table(d: dict) -> None:
    print(f"flavor {d['flavor']}  mixer {d['mixer']}  pattern {d['pattern']}  ({d['n_layers']} sublayers, "
          f"dim {d['dim']}, vocab {d['vocab_size']}, {'tied' if d['tie_embeddings'] else 'untied'} embeddings)")
    print(f"{'idx':>4} {'sym':>3} {'kind':<10} {'params':>14} {'GFLOP/token':>12}")
    for layer in d["layers"]:
        print(f"{layer['index']:>4} {layer['symbol']:>3} {layer['kind']:<10} {layer['params']:>14,} "
              f"{layer['flops_per_token'] / 1e9:>12.4f}")
    print(f"parameters: {d['params_total']:,} total, {d['params_non_embedding']:,} non-embedding "
          f"(embedding {d['params_embedding']:,})")
    print(f"training FLOPs per token at seq_len {d['seq_len']}: {d['flops_per_token'] / 1e9:.4f} G "
          f"(output layer {d['flops_per_token_output_layer'] / 1e9:.4f} G)")
    for line in d["float8"]["summary"] if d["float8"] else []:
        print(line)
    m = d["memory_estimate_gib"]
    print(f"memory estimate per device, local batch {d['local_batch_size']} x {d['seq_len']}: "
          f"{m['total']:.2f} GiB = states {m['params_grads_optimizer']:.2f} + activations {m['activations']:.2f} "
          + (f"+ teacher {m['teacher']:.2f} " if m["teacher"] else "") +
          f"+ loss chunk {m['loss_chunk']:.2f}  ({m['assumes']})")
    if m["teacher_host_while_loading"]:
        print(f"host memory per rank while the teacher loads: {m['teacher_host_while_loading']:.2f} GiB (each rank "
              f"reads its shard alone; the whole teacher is {m['teacher_whole']:.2f} GiB)")


def batch_plan(cfg: JobConfig, world_size: int) -> dict:
    """The batch arithmetic of a recipe on ``world_size`` ranks.

    It gives the data-parallel layout, and whether the global batch divides into every rank's local batches and
    micro-batches. Where it does not, it gives the largest local batch, up to the recipe's, that does, with its gradient
    accumulation. A layout that cannot exist gives {"problem": ...}."""
    from hybridtitan.parallel import resolve_data_parallel

    p = cfg.parallelism
    cp = p.context_parallel_degree  # the ranks of a context-parallel group read the same batch
    if world_size % cp:
        return {"world_size": world_size, "ok": False,
                "problem": f"parallelism.context_parallel_degree ({cp}) must divide the {world_size} ranks"}
    try:
        dp = resolve_data_parallel(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, world_size // cp)
    except ValueError as e:
        return {"world_size": world_size, "ok": False, "problem": str(e)}
    t = cfg.training
    per_step = t.local_batch_size * dp.size
    global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    out = {"world_size": world_size, "replicate": dp.replicate, "shard": dp.shard, "global_batch": global_batch,
           "local_batch": t.local_batch_size, "ok": global_batch % per_step == 0}
    if out["ok"]:
        out["accumulation"] = global_batch // per_step
        return out
    fits = [b for b in range(t.local_batch_size, 0, -1) if global_batch % (b * dp.size) == 0]
    out["problem"] = (f"training.global_batch_size ({global_batch}) is not divisible by local_batch_size x "
                      f"data-parallel size ({t.local_batch_size} x {dp.size} = {per_step})")
    if fits:
        out["suggestion"] = {"local_batch": fits[0], "accumulation": global_batch // (fits[0] * dp.size)}
    return out


def plan_lines(cfg: JobConfig, plan: dict, nodes: int | None, data_problem: str | None) -> tuple[list[str], bool]:
    """What describe --world-size says of a plan, and whether it holds."""
    where = f"{plan['world_size']} GPUs" + (f" ({nodes} node{'s' if nodes > 1 else ''} x {plan['world_size'] // nodes})"
                                                if nodes else "")
    if "replicate" not in plan:
        return [f"plan for {where}: {plan['problem']}"], False
    lines = [f"plan for {where}: data parallel replicate {plan['replicate']} x shard {plan['shard']}, global batch "
             f"{plan['global_batch']} x {cfg.training.seq_len} tokens"]
    if plan["ok"]:
        lines.append(f"  local batch {plan['local_batch']}, gradient accumulation {plan['accumulation']}: OK")
    else:
        fix = plan.get("suggestion")
        lines.append(f"  {plan['problem']}" + (
            f": use --training.local_batch_size {fix['local_batch']} (gradient accumulation {fix['accumulation']})"
            if fix else f": the global batch is smaller than the {plan['shard'] * plan['replicate']} data-parallel "
                        "ranks; raise training.global_batch_size to a multiple of them"))
    if data_problem:
        lines.append(f"  data: {data_problem}")
    return lines, plan["ok"] and not data_problem


def data_problem(cfg: JobConfig) -> str | None:
    """Runs the trainer's checks of the data before a run: files, manifests, tokenizer, held-out overlap. Returns the
    problem in one line, or None."""
    from hybridtitan.config_manager import validate
    from hybridtitan.data import build_tokenizer
    from hybridtitan.preflight import check_data_files

    try:
        validate(cfg, check_data=True)
        tokenizer = build_tokenizer(cfg.data.tokenizer) if cfg.data.source != "mock" else None
        check_data_files(cfg, tokenizer)
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


USAGE = """usage: python -m hybridtitan.describe --job.config_file RECIPE.toml [--section.key VALUE ...] [--json]
           [--world-size N | --nodes N [--gpus-per-node G]] [--check]
       python -m hybridtitan.describe --list
       python -m hybridtitan.describe --config-reference

What a recipe builds, without building it: the layer plan, parameters, FLOPs per token per sublayer and a
memory estimate per device. --json prints it as one JSON object; --list lists the flavors. --world-size (or
--nodes x --gpus-per-node, 8 by default) plans the run on that many GPUs: the data-parallel layout, the batch
arithmetic (and the local batch and accumulation that would work), the memory per GPU at that sharding and the
data as the trainer will check it; --check then exits with code 2 if the plan does not hold (Slurm runs it before
training: scripts/slurm/train.sbatch). The recipe's keys are the trainer's:"""

PLAN_FLAGS = {"--world-size": "world_size", "--nodes": "nodes", "--gpus-per-node": "gpus_per_node"}


def _plan_options(argv: list[str]) -> tuple[list[str], dict]:
    """(the recipe's arguments, {world_size, nodes, gpus_per_node, check}) from describe's command line."""
    rest, options, i = [], {"check": False}, 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in PLAN_FLAGS:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            try:
                options[PLAN_FLAGS[name]] = int(value)
            except ValueError:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}") from None
            if options[PLAN_FLAGS[name]] < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        elif arg == "--check":
            options["check"] = True
        else:
            rest.append(arg)
        i += 1
    if "nodes" in options:
        options["world_size"] = options["nodes"] * options.get("gpus_per_node", 8)
    if options["check"] and "world_size" not in options:
        raise ConfigError("--check plans a run: give --world-size N or --nodes N [--gpus-per-node G]")
    return rest, options


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # nothing given: the defaults alone are no recipe anyone trains
        print(USAGE.split("\n\n")[0] + "\nerror: give a recipe (train_configs/*.toml) or --list", file=sys.stderr)
        sys.exit(2)
    if "--config-reference" in argv:  # docs/config-reference.md
        print(config_reference())
        return
    if "--list" in argv:
        for name, a in FLAVORS.items():
            print(f"{name:<20} {a.mixer:<7} {a.pattern}")
        return
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    with one_line_errors(ValueError):
        argv, options = _plan_options(argv)
        cfg = parse_config(argv, check_data=False, usage=USAGE)
        lines, holds = [], True
        if "world_size" in options:
            plan = batch_plan(cfg, options["world_size"])
            if "shard" in plan:  # the memory per GPU at this sharding, with the batch that would run
                local_batch = (plan.get("suggestion") or {}).get("local_batch", cfg.training.local_batch_size)
                cfg = dataclasses.replace(
                    cfg, parallelism=dataclasses.replace(cfg.parallelism, data_parallel_shard_degree=plan["shard"]),
                    training=dataclasses.replace(cfg.training, local_batch_size=local_batch))
            lines, holds = plan_lines(cfg, plan, options.get("nodes"), data_problem(cfg))
        d = describe(cfg)
    if as_json:
        print(json.dumps({**d, **({"plan": {"lines": lines, "holds": holds}} if lines else {})}))
    else:
        _print_table(d)
        for line in lines:
            print(line)
    if options["check"] and not holds:
        print(f"error: the plan for {options['world_size']} GPUs does not hold (above)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
