"""DCP -> Hugging Face export and back: every debug flavor, trained for a few steps by the real trainer.

Pure GDN/KDA exports are in FLA's layouts: FLA's classes (built from the exported config) must load them with no
missing, unexpected or mismatched key, every tensor equal to ours; FLA's forward needs a GPU, so their logits are
checked by reading the export back into HybridLM. Our own layout (Mamba2, MLA hybrids, and GDN/KDA with
--format hybridtitan) goes through transformers' Auto classes, forward and generate(), with and without the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import Started, env, start

REPO = Path(__file__).resolve().parents[1]
FLAVORS = ("debug_gdn", "debug_kda", "debug_mamba2", "debug_hybrid")
STEPS = 2


def run_cli(*args: str) -> Started:
    """``python -m ARGS`` (helpers.start: forked from the preloaded server), used as a Popen."""
    return start(["-m", *args])


def train_debug_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A dump folder per debug flavor, trained for STEPS steps by `python -m hybridtitan.train` (the four runs in
    parallel), once per session: under pytest-xdist in the session's folder shared by the workers (the first
    worker trains, under a file lock, the others wait and reuse), so any test module may call this."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, the parent of every worker's popen-gwK/
    base = root / "hybridtitan_debug_dumps"
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base) + ".lock"):
        dumps = {f: base / f for f in FLAVORS}
        todo = [f for f in FLAVORS if not (dumps[f] / "checkpoint" / f"step-{STEPS}" / ".metadata").is_file()]
        procs = {}
        for f in todo:
            shutil.rmtree(dumps[f], ignore_errors=True)
            procs[f] = run_cli(
                "hybridtitan.train", "--job.config_file", "train_configs/debug_hybrid.toml", "--model.flavor", f,
                "--training.steps", str(STEPS), "--checkpoint.interval", str(STEPS), "--job.dump_folder",
                str(dumps[f]), "--training.local_batch_size", "2", "--training.global_batch_size", "2",
                "--training.seq_len", "64", "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1",
                "--validation.enable", "false")
        for f, p in procs.items():
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, f"training {f} failed:\n{(out + err)[-4000:]}"
    return dumps


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    return train_debug_checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def exports(trained, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(flavor, layout) -> float32 export: FLA's layout for GDN/KDA, ours for every flavor."""
    from hybridtitan.export_hf import export

    base = tmp_path_factory.mktemp("exports")
    out = {}
    for flavor in FLAVORS:
        layouts = ("fla", "hybridtitan") if flavor in ("debug_gdn", "debug_kda") else ("hybridtitan",)
        for layout in layouts:
            path = base / f"{flavor}-{layout}"
            assert export(str(trained[flavor]), str(path), dtype="float32", format=layout) == layout
            out[flavor, layout] = path
    return out


def ours(dump: Path):
    from hybridtitan.checkpoint import load_model

    return load_model(str(dump), "cpu", torch.float32)[0].eval()


def _cache(out):
    """The cache of a forward's output, under the field name of the installed transformers release."""
    from hybridtitan.hf.modeling import _CACHE_FIELD

    return getattr(out, _CACHE_FIELD)


def tokens(shape, seed=0):
    return torch.randint(5, 8000, shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ our own layout


@pytest.mark.parametrize("flavor", FLAVORS)
def test_own_layout_logits_and_generate(flavor, trained, exports):
    from transformers import AutoModelForCausalLM

    import hybridtitan.hf  # noqa: F401 -- registers the Auto classes
    from hybridtitan.hf import HybridTitanForCausalLM

    folder = exports[flavor, "hybridtitan"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "hybridtitan" and config["auto_map"]["AutoModelForCausalLM"]
    assert (folder / "modeling_hybridtitan.py").is_file() and (folder / "tokenizer.json").is_file()
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast" and "local_files_only" not in tok_config
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == config["eos_token_id"]

    ref = ours(trained[flavor])
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    assert isinstance(hf, HybridTitanForCausalLM) and hf.dtype == torch.float32
    x = tokens((2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ref(x), atol=1e-5, rtol=0)

    # generate(): greedy, with the recurrent/MLA cache (one token per step after the prompt) and without it
    seen = []
    hook = hf.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    prompt, new = tokens((1, 9), seed=1), 6
    with_cache = hf.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=True)
    assert seen == [9] + [1] * (new - 1), seen
    seen.clear()
    without = hf.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=False)
    assert seen == list(range(9, 9 + new)), seen
    hook.remove()
    assert with_cache.shape == (1, 9 + new)
    assert torch.equal(with_cache, without)
    # and the same tokens as HybridLM's own greedy loop
    seq = prompt
    with torch.no_grad():
        for _ in range(new):
            seq = torch.cat([seq, ref(seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(with_cache, seq)


def test_output_hidden_states(exports):
    """output_hidden_states, as transformers' models give it: the embeddings' output, the residual stream entering
    each later sublayer, and the final-normed states. Entry k is checked against the first k sublayers alone."""
    import copy

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(exports["debug_hybrid", "hybridtitan"]),
                                              trust_remote_code=True).eval()
    n, x = hf.config.num_hidden_layers, tokens((2, 20))
    with torch.no_grad():
        out = hf(x, output_hidden_states=True)
        states = out.hidden_states
        assert len(states) == n + 1 and all(s.shape == (2, 20, hf.config.hidden_size) for s in states)
        torch.testing.assert_close(states[0], hf.model.embeddings(x))
        torch.testing.assert_close(states[-1] @ hf.model.output_weight.t(), out.logits, atol=1e-5, rtol=0)
        for k in range(1, n):
            first_k = copy.deepcopy(hf.model)
            first_k.layers = first_k.layers[:k]
            torch.testing.assert_close(hf.model.norm(states[k]), first_k.hidden_states(x), atol=1e-5, rtol=1e-5)
        assert hf(x).hidden_states is None
        as_tuple = hf(x, output_hidden_states=True, use_cache=False, return_dict=False)
        assert len(as_tuple) == 2 and torch.equal(as_tuple[0], out.logits)
        assert all(torch.equal(a, b) for a, b in zip(as_tuple[1], states, strict=True))


RESAVE = """
import sys, torch
from transformers import AutoModelForCausalLM
src, dst, logits = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True).eval()  # no hybridtitan import here
if dst != "-":
    model.save_pretrained(dst)
x = torch.randint(5, 8000, (2, 16), generator=torch.Generator().manual_seed(3))
with torch.no_grad():
    torch.save(model(x).logits, logits)
"""


def test_trust_remote_code_folder_saved_again_still_loads(trained, exports, tmp_path):
    """A model loaded with trust_remote_code and saved with save_pretrained (fine-tuning with HF tools) keeps a
    folder that loads the same way in a fresh process, with the same logits; no module of ours copied into it."""
    from hybridtitan.hf.configuration import AUTO_MAP
    from hybridtitan.hf.remote import FILES

    again = tmp_path / "again"
    for src, dst, logits in ((exports["debug_hybrid", "hybridtitan"], again, tmp_path / "a.pt"),
                             (again, "-", tmp_path / "b.pt")):
        proc = subprocess.run([sys.executable, "-c", RESAVE, str(src), str(dst), str(logits)], cwd=tmp_path,
                              env=env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((again / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert sorted(p.name for p in again.glob("*.py")) == sorted(FILES)
    ref = ours(trained["debug_hybrid"])
    x = torch.randint(5, 8000, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(x)
    for name in ("a.pt", "b.pt"):
        torch.testing.assert_close(torch.load(tmp_path / name), expected, atol=1e-5, rtol=0)


def test_a_kernel_failure_is_one_line_saying_what_to_install(exports, tmp_path, monkeypatch):
    """An error raised inside Triton's or FLA's code (here a stand-in module under a folder named triton) reaches
    the user as one line naming the versions and what to install; any other error passes unchanged."""
    import importlib.util

    from hybridtitan.hf.modeling import HybridTitanForCausalLM

    model = HybridTitanForCausalLM.from_pretrained(str(exports["debug_hybrid", "hybridtitan"])).eval()
    fake = tmp_path / "triton" / "compiler.py"
    fake.parent.mkdir()
    fake.write_text("def compile(*args, **kwargs):\n    raise RuntimeError('PassManager::run failed\\nmore')\n")
    spec = importlib.util.spec_from_file_location("fake_triton_compiler", fake)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(model.model, "hidden_states", module.compile)
    model.uses_fla_kernels = True
    with pytest.raises(RuntimeError) as e:
        model(input_ids=tokens((1, 8)))
    message = str(e.value)
    assert "\n" not in message and "PassManager::run failed" in message and "pip install -U 'triton>=3.7.1'" in message
    assert "use_fla_kernels=False" in message and e.value.__cause__ is None
    model.uses_fla_kernels = False  # the PyTorch forms: an error is not a kernel's
    with pytest.raises(RuntimeError, match="^PassManager::run failed"):
        model(input_ids=tokens((1, 8)))

    def our_bug(*args, **kwargs):
        raise ValueError("a bug of ours")

    model.uses_fla_kernels = True
    monkeypatch.setattr(model.model, "hidden_states", our_bug)
    with pytest.raises(ValueError, match="a bug of ours"):
        model(input_ids=tokens((1, 8)))


def test_cache_is_a_transformers_cache(exports):
    from transformers.cache_utils import Cache

    from hybridtitan.hf import HybridCache, HybridTitanForCausalLM

    hf = HybridTitanForCausalLM.from_pretrained(str(exports["debug_hybrid", "hybridtitan"])).eval()
    x = tokens((2, 7))
    with torch.no_grad():
        out = hf(x, use_cache=True)
        cache = _cache(out)
        assert isinstance(cache, HybridCache) and isinstance(cache, Cache)
        assert cache.get_seq_length() == 7 and cache.batch_size == 2
        latents = [s for s in cache.inner.layers if "c_kv" in s]
        assert latents and latents[0]["c_kv"].shape[:2] == (2, 7)  # MLA caches its latent, not K and V
        cache.reorder_cache(torch.tensor([1, 0]))
        step = hf(torch.full((2, 1), 42), cache=cache, use_cache=True).logits
        full = hf(torch.cat([x[[1, 0]], torch.full((2, 1), 42)], dim=1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)
    # a left-padded batch decodes each row as its prompt alone (its pads set aside)
    padded = hf.generate(x, attention_mask=torch.tensor([[0] * 2 + [1] * 5, [1] * 7]), max_new_tokens=2)
    assert torch.equal(padded[0, -2:], hf.generate(x[:1, 2:], max_new_tokens=2)[0, -2:])
    # a right-padded batch in a plain eval forward (scoring) is right, without a cache; a cache asked for is refused
    mask = torch.tensor([[1] * 4 + [0] * 3, [1] * 7])
    with torch.no_grad():
        out = hf(x, attention_mask=mask)
        alone = hf(x[:1, :4]).logits
    assert _cache(out) is None
    torch.testing.assert_close(out.logits[:1, :4], alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="padded"):
        hf(x, attention_mask=mask, use_cache=True)
    with torch.no_grad():
        cache = _cache(hf(x[:, :4]))
    with pytest.raises(ValueError, match="padded"):  # a cache passed in is used, never dropped
        hf(x[:, 4:], past_key_values=cache, attention_mask=mask)
    # ... also with use_cache=False, in training mode, or with the config's use_cache off: it is used and advanced
    full = hf(x).logits
    for mode, kwargs in (("eval", {"use_cache": False}), ("train", {}), ("eval", {"config_off": True})):
        hf.train(mode == "train")
        hf.config.use_cache = not kwargs.pop("config_off", False)
        with torch.no_grad():
            cache = _cache(hf(x[:, :3], use_cache=True))
            rest = hf(x[:, 3:], past_key_values=cache, **kwargs).logits
        assert cache.get_seq_length() == 7, (mode, kwargs)
        torch.testing.assert_close(rest, full[:, 3:], atol=1e-4, rtol=1e-4)
    hf.config.use_cache = True


def test_resized_embeddings_save_and_load_again(exports, tmp_path):
    from hybridtitan.hf import HybridTitanForCausalLM

    hf = HybridTitanForCausalLM.from_pretrained(str(exports["debug_hybrid", "hybridtitan"]))
    hf.resize_token_embeddings(8200)
    hf.save_pretrained(tmp_path / "resized")
    again = HybridTitanForCausalLM.from_pretrained(str(tmp_path / "resized"))
    assert again.config.vocab_size == again.config.to_model_args().vocab_size == 8200
    assert again.get_input_embeddings().weight.shape[0] == 8200
    torch.testing.assert_close(again.get_input_embeddings().weight, hf.get_input_embeddings().weight)


def test_untied_embeddings_resize(tmp_path):
    """An untied model (--model.tie_embeddings false, or an import of an untied FLA model) resizes both tables."""
    import dataclasses

    from hybridtitan.hf import HybridTitanConfig, HybridTitanForCausalLM
    from hybridtitan.models import get_flavor

    torch.manual_seed(0)
    config = HybridTitanConfig.from_model_args(dataclasses.replace(get_flavor("debug_hybrid"), tie_embeddings=False))
    hf = HybridTitanForCausalLM(config).eval()
    x = tokens((1, 12))
    with torch.no_grad():
        before = hf(x).logits
    hf.resize_token_embeddings(8200)
    assert hf.get_output_embeddings().weight.shape == (8200, config.hidden_size)
    assert hf.get_output_embeddings() is hf.model.lm_head and hf.model.lm_head.weight is not hf.model.embeddings.weight
    hf.save_pretrained(tmp_path / "resized")
    again = HybridTitanForCausalLM.from_pretrained(str(tmp_path / "resized")).eval()
    with torch.no_grad():
        after = again(x).logits
    assert after.shape[-1] == 8200
    torch.testing.assert_close(after[..., :before.shape[-1]], before, atol=1e-5, rtol=0)


def test_loss_over_accumulated_micro_batches_and_return_dict(exports):
    """transformers' Trainer with gradient accumulation passes num_items_in_batch (the counted labels of the whole
    step) and does not scale the loss: the micro-batches' losses and gradients add up to the whole batch's."""
    from transformers import AutoModelForCausalLM

    folder = str(exports["debug_hybrid", "hybridtitan"])
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).train()
    x = tokens((4, 16))
    labels = x.clone()
    labels[0, 5:] = -100  # rows with different counts: a mean per micro-batch would weigh them wrongly
    hf(x, labels=labels).loss.backward()
    whole = {n: p.grad.clone() for n, p in hf.named_parameters()}
    whole_loss = hf(x, labels=labels).loss.detach()
    hf.zero_grad()
    count = (labels[:, 1:] != -100).sum()
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        loss = hf(x[rows], labels=labels[rows], num_items_in_batch=count).loss
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, whole_loss, atol=1e-5, rtol=1e-5)
    for n, p in hf.named_parameters():
        torch.testing.assert_close(p.grad, whole[n], atol=1e-5, rtol=1e-4)

    as_tuple = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, return_dict=False).eval()
    with torch.no_grad():
        out = as_tuple(x, labels=labels, use_cache=False)
    assert isinstance(out, tuple) and len(out) == 2 and out[1].shape == (4, 16, hf.config.vocab_size)


def test_gradient_checkpointing(exports, tmp_path):
    """Activation checkpointing switched on as transformers' Trainer does it: the sublayers recomputed, the same loss
    and gradients, the same weight names saved; switched off, the plain sublayers again."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from hybridtitan.hf import HybridTitanForCausalLM

    hf = HybridTitanForCausalLM.from_pretrained(str(exports["debug_hybrid", "hybridtitan"])).train()
    # transformers 5.24 renamed gradient_checkpointing_enable (kept as a deprecated alias) and added every_n_layers
    renamed = hasattr(hf, "activation_checkpointing_enable")
    enable = hf.activation_checkpointing_enable if renamed else hf.gradient_checkpointing_enable
    disable = hf.activation_checkpointing_disable if renamed else hf.gradient_checkpointing_disable
    x = tokens((2, 16))

    def loss_and_grads():
        hf.zero_grad()
        loss = hf(x, labels=x).loss
        loss.backward()
        # named_parameters (unlike state_dict) names the checkpoint wrapper's child too
        return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                               for n, p in hf.named_parameters()}

    plain_loss, plain = loss_and_grads()
    names = list(hf.state_dict())
    enable()
    assert hf.gradient_checkpointing and all(isinstance(layer, CheckpointWrapper) for layer in hf.model.layers)
    recomputed = []
    # a pre-hook: the recomputation stops as soon as it has what the backward needs, before a forward hook
    hooks = [layer._checkpoint_wrapped_module.register_forward_pre_hook(lambda *a: recomputed.append(1))
             for layer in hf.model.layers]
    loss, grads = loss_and_grads()
    assert len(recomputed) == 2 * len(hf.model.layers)  # each sublayer ran again in the backward pass
    for h in hooks:
        h.remove()
    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=1e-6)
    assert set(grads) == set(plain)
    for n in plain:
        torch.testing.assert_close(grads[n], plain[n], atol=1e-6, rtol=1e-5)
    assert list(hf.state_dict()) == names
    hf.save_pretrained(tmp_path / "saved")
    assert list(HybridTitanForCausalLM.from_pretrained(str(tmp_path / "saved")).state_dict()) == names
    disable()
    assert not hf.gradient_checkpointing and not any(isinstance(m, CheckpointWrapper) for m in hf.modules())
    assert all(type(layer).__name__ == "Sublayer" for layer in hf.model.layers)
    if renamed:
        enable(every_n_layers=2)
        assert [isinstance(layer, CheckpointWrapper) for layer in hf.model.layers] == [True, False] * 4
        torch.testing.assert_close(loss_and_grads()[0], plain_loss, atol=1e-6, rtol=1e-6)
        disable()
    # a reentrant checkpoint cannot pass the sublayers' keyword arguments: asked for, or left to torch's default
    # (reentrant), it runs non-reentrant
    for kwargs in ({"use_reentrant": True}, {"preserve_rng_state": False}):
        enable(kwargs)
        torch.testing.assert_close(loss_and_grads()[0], plain_loss, atol=1e-6, rtol=1e-6)
    # with gradients on, the recomputation would advance a cache a second time: none is made, one passed is refused
    hf.eval()
    out = hf(x, labels=x)
    assert _cache(out) is None
    out.loss.backward()
    with torch.no_grad():
        cache = _cache(hf(x[:, :8], use_cache=True))
    with pytest.raises(ValueError, match="activation checkpointing"):
        hf(x[:, 8:], past_key_values=cache)
    disable()


# ------------------------------------------------------------------------------------------ FLA's layouts


@pytest.mark.parametrize("flavor", ["debug_gdn", "debug_kda"])
def test_fla_layout_loads_in_fla(flavor, trained, exports):
    import warnings

    warnings.filterwarnings("ignore", message="Triton is not supported")
    import fla  # noqa: F401 -- registers FLA's Auto classes
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hybridtitan.checkpoint import load_model_args
    from hybridtitan.hf.convert import load_hf_model, to_fla_key

    folder = exports[flavor, "fla"]
    args = load_model_args(str(trained[flavor] / "checkpoint" / f"step-{STEPS}"))
    m = getattr(args, args.mixer)
    config = json.loads((folder / "config.json").read_text())
    expected = {
        "model_type": {"debug_gdn": "gated_deltanet", "debug_kda": "kda"}[flavor],
        "architectures": [{"debug_gdn": "GatedDeltaNetForCausalLM", "debug_kda": "KDAForCausalLM"}[flavor]],
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers // 2, "num_heads": m.num_heads,
        "head_dim": m.head_dim, "expand_v": m.head_v_dim / m.head_dim, "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size, "norm_eps": args.norm_eps, "conv_size": m.conv_size,
        "use_short_conv": True, "tie_word_embeddings": True, "hidden_act": "swish", "attn": None,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1,
    }
    if flavor == "debug_gdn":
        expected.update(num_v_heads=m.num_v_heads, use_gate=True)
    assert {k: config.get(k) for k in expected} == expected
    assert not (folder / "modeling_hybridtitan.py").exists()

    files = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in files  # tied: FLA ties it on load; no two tensors share storage in the file
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert type(model).__name__ == expected["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    fla_state = model.state_dict()
    assert model.lm_head.weight.data_ptr() == model.model.embeddings.weight.data_ptr()
    ref = ours(trained[flavor])
    mapped = {to_fla_key(k): v for k, v in ref.state_dict().items()}
    assert set(fla_state) - {"lm_head.weight"} == set(mapped) == set(files)
    for key, value in mapped.items():
        assert fla_state[key].shape == value.shape and torch.equal(fla_state[key], value), key

    # FLA's forward needs a GPU: read the export back into HybridLM (the reverse mapping) and compare logits
    back = load_hf_model(str(folder)).eval()
    x = tokens((2, 20))
    with torch.no_grad():
        torch.testing.assert_close(back(x), ref(x), atol=1e-5, rtol=0)


def test_import_fla_to_dcp_step0_and_train_from_it(trained, exports, tmp_path):
    """import_hf (CLI) turns an FLA export into a DCP step-0 with the same logits, and training starts from it."""
    from hybridtitan.checkpoint import load_model
    from hybridtitan.import_hf import import_hf
    from hybridtitan.model_folder import read_folder

    step0 = tmp_path / "gdn" / "checkpoint" / "step-0"
    p = run_cli("hybridtitan.import_hf", "--model", str(exports["debug_gdn", "fla"]), "--output", str(step0))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert (step0 / ".metadata").is_file() and (step0 / "tokenizer" / "tokenizer.json").is_file()
    assert read_folder(str(step0)).tokenizer == str(step0 / "tokenizer")  # where export and eval find it
    x = tokens((2, 16))
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(step0))[0](x), ours(trained["debug_gdn"])(x), atol=1e-5, rtol=0)

    # our own export of KDA imports too (in-process API)
    kda0 = tmp_path / "kda" / "step-0"
    assert import_hf(str(exports["debug_kda", "hybridtitan"]), str(kda0)) == "hybridtitan"
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(kda0))[0](x), ours(trained["debug_kda"])(x), atol=1e-5, rtol=0)

    # the trainer treats a step-0 in its dump folder as a model-only start and trains on
    t = run_cli("hybridtitan.train", "--job.config_file", "train_configs/debug_hybrid.toml", "--model.flavor",
                "debug_gdn", "--training.steps", "1", "--job.dump_folder", str(tmp_path / "gdn"),
                "--checkpoint.interval", "1", "--training.local_batch_size", "2", "--training.global_batch_size", "2",
                "--training.seq_len", "64", "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1")
    out, err = t.communicate(timeout=600)
    assert t.returncode == 0, (out + err)[-3000:]
    assert "step-0" in out + err and (tmp_path / "gdn" / "checkpoint" / "step-1" / ".metadata").is_file()


def test_sharded_bfloat16_export(trained, tmp_path):
    """Past max_shard_size the weights are sharded with an index; --dtype bfloat16 casts every tensor."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hybridtitan.hf  # noqa: F401
    from hybridtitan.export_hf import export

    out = tmp_path / "sharded"
    export(str(trained["debug_hybrid"]), str(out), dtype="bfloat16", max_shard_size=1_000_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    ref = ours(trained["debug_hybrid"]).state_dict()
    largest = max(t.numel() * 2 for t in ref.values())  # one tensor may exceed the limit alone
    stored = {}
    for name in shards:
        assert (out / name).stat().st_size <= 1_000_000 + largest
        stored.update(load_file(str(out / name)))
    assert set(stored) == {"model." + k for k in ref}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in ref.values())
    for k, v in ref.items():
        assert stored["model." + k].dtype == torch.bfloat16 and torch.equal(stored["model." + k], v.to(torch.bfloat16))
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    assert hf.dtype == torch.bfloat16
    assert not list(tmp_path.glob(".*export*"))  # no temporary folder left


# ------------------------------------------------------------------------------------------ bad input


def _expect_error(capsys, main, argv, match: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err, err
    return err


def test_export_bad_input(trained, tmp_path, capsys):
    from hybridtitan.export_hf import main

    dump = trained["debug_hybrid"]
    out = tmp_path / "out"
    # missing checkpoint folder
    _expect_error(capsys, main, ["--checkpoint", str(tmp_path / "nope"), "--output", str(out)], "not found")
    # a dump folder that holds only an interrupted save
    partial = tmp_path / "partial"
    shutil.copytree(dump / "checkpoint" / f"step-{STEPS}", partial / f"step-{STEPS}.partial")
    _expect_error(capsys, main, ["--checkpoint", str(partial), "--output", str(out)], "incomplete")
    # a step folder whose data file is gone
    broken = tmp_path / "broken" / f"step-{STEPS}"
    shutil.copytree(dump / "checkpoint" / f"step-{STEPS}", broken)
    for f in broken.glob("*.distcp"):
        f.unlink()
    _expect_error(capsys, main, ["--checkpoint", str(broken), "--output", str(out)], "cannot read the model")
    # step not found
    _expect_error(capsys, main, ["--checkpoint", str(dump), "--step", "7", "--output", str(out)], "step 7 not found")
    # FLA's layout asked for a hybrid
    _expect_error(capsys, main, ["--checkpoint", str(dump), "--format", "fla", "--output", str(out)], "--format fla")
    # an unknown option: one line too
    _expect_error(capsys, main, ["--checkpoint", str(dump), "--output", str(out), "--dtype", "int3"], "--dtype")
    assert not out.exists() and not list(tmp_path.glob(".out.export*"))
    # an existing output folder is refused and left intact, and --overwrite replaces only an earlier export: a
    # folder of other things stays as it is
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _expect_error(capsys, main, ["--checkpoint", str(dump), "--output", str(out)], "exists")
    _expect_error(capsys, main, ["--checkpoint", str(dump), "--output", str(out), "--overwrite"],
                  "--overwrite replaces only an earlier export (only the files an export writes)")
    (out / "config.json").write_text("{}")  # a project's config beside its other files is not an export
    _expect_error(capsys, main, ["--checkpoint", str(dump), "--output", str(out), "--overwrite"], "keep.txt")
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 2
    shutil.rmtree(out)
    out.mkdir()  # an empty folder is written without --overwrite
    main(["--checkpoint", str(dump), "--output", str(out)])
    stale = out / "model-00002-of-00002.safetensors"  # an earlier export's, sharded: replaced with the rest
    stale.write_bytes(b"")
    main(["--checkpoint", str(dump), "--output", str(out), "--overwrite"])
    assert not stale.exists() and (out / "config.json").is_file()
    # --overwrite never replaces the folder that holds the checkpoint itself
    for holder in (dump, dump / "checkpoint"):
        _expect_error(capsys, main, ["--checkpoint", str(dump), "--output", str(holder), "--overwrite"],
                      "choose another folder")
    assert (dump / "checkpoint" / f"step-{STEPS}" / "model_args.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_import_bad_input(trained, exports, tmp_path, capsys):
    from hybridtitan.import_hf import main

    out = tmp_path / "checkpoint" / "step-0"
    _expect_error(capsys, main, ["--model", str(tmp_path / "nope"), "--output", str(out)], "not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_error(capsys, main, ["--model", str(empty), "--output", str(out)], "no config.json")
    foreign = tmp_path / "foreign"
    shutil.copytree(exports["debug_gdn", "fla"], foreign)
    cfg = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    _expect_error(capsys, main, ["--model", str(foreign), "--output", str(out)], "model_type 'mistral'")
    (foreign / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))  # a Llama's keys missing
    _expect_error(capsys, main, ["--model", str(foreign), "--output", str(out)],
                  "a Llama config needs num_attention_heads")
    (foreign / "config.json").write_text(json.dumps({**cfg, "allow_neg_eigval": True}))
    _expect_error(capsys, main, ["--model", str(foreign), "--output", str(out)], "allow_neg_eigval")
    kda_cfg = json.loads((exports["debug_kda", "fla"] / "config.json").read_text())
    for field, value in (("lower_bound", -5.0), ("safe_gate", True)):  # FLA's other KDA gate
        (foreign / "config.json").write_text(json.dumps({**kda_cfg, field: value}))
        _expect_error(capsys, main, ["--model", str(foreign), "--output", str(out)], field)
    (foreign / "config.json").write_text(json.dumps(cfg))
    (foreign / "model.safetensors").unlink()
    _expect_error(capsys, main, ["--model", str(foreign), "--output", str(out)], "no weights")
    assert not out.exists()
    # a later step of a run's checkpoint folder: the trainer would refuse to go on from a model-only step there
    _expect_error(capsys, main, ["--model", str(exports["debug_gdn", "fla"]), "--output",
                                 str(tmp_path / "checkpoint" / "step-9")], "checkpoint/step-0 only")
    # an existing folder is refused; --overwrite replaces only a step folder (an earlier import), never a training
    # run's dump or checkpoint folder
    run = tmp_path / "run"
    (run / "checkpoint" / "step-4").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    model = str(exports["debug_gdn", "fla"])
    _expect_error(capsys, main, ["--model", model, "--output", str(run)], "exists")
    # a training checkpoint (optimizer, data position) is not replaced by a model-only import either
    full = run / "checkpoint" / f"step-{STEPS}"
    shutil.copytree(trained["debug_gdn"] / "checkpoint" / f"step-{STEPS}", full)
    for target in (run, run / "checkpoint", full):
        _expect_error(capsys, main, ["--model", model, "--output", str(target), "--overwrite"],
                      "--overwrite replaces only an earlier import (a model-only step folder)")
    assert (run / "metrics.jsonl").is_file() and (run / "checkpoint" / "step-4").is_dir()
    assert (full / "model_args.json").is_file()
    # an earlier import is replaced
    main(["--model", model, "--output", str(out)])
    main(["--model", model, "--output", str(out), "--overwrite"])
    assert (out / ".metadata").is_file()
