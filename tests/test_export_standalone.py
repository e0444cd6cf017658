"""Exports in hybridtitan's own layout load without hybridtitan: the folder carries the package's own modules,
written flat (hybridtitan.hf.remote) and named by auto_map, so the code an export runs is the code the package
runs.

Two levels:

* in this process, the folder's files imported by path as a package of their own (no trust_remote_code
  machinery), for every debug flavor (GDN and KDA with --format hybridtitan): logits, cached decoding, greedy
  tokens, left-padded batches against HybridLM on the same weights, and what transformers' tools use (the cache,
  resizing and saving, activation checkpointing, a fresh init, bf16);
* in a fresh virtual environment that holds torch, transformers and safetensors only (made once per session; no
  hybridtitan, no FLA), AutoModelForCausalLM / AutoTokenizer with trust_remote_code=True, for debug_hybrid and
  debug_mamba2: logits, greedy generate() tokens and a left-padded batch against HybridLM here. The processes
  exchange files.

The environment takes ~17 s to make on a 2-core machine (tests/venvs.py, then pip resolving transformers'
dependencies against the package mirrors; 2026-12-04); HYBRIDTITAN_STANDALONE_PYTHON=/path/to/python reuses one
made before (it must lack hybridtitan and FLA: the test checks).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from test_export_hf import FLAVORS, train_debug_checkpoints  # the session's trained dumps, shared
from venvs import make_venv, pip_install

REPO = Path(__file__).resolve().parents[1]
# what the entry points may import at their top level besides torch and transformers (transformers imports each
# one before it runs the folder's code: a package outside the standard library there fails the load)
STDLIB = set(sys.stdlib_module_names)


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    return train_debug_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory) -> dict[str, Path]:
    """flavor -> float32 export in hybridtitan's layout (GDN and KDA with --format hybridtitan)."""
    from hybridtitan.export_hf import export

    base = tmp_path_factory.mktemp("standalone_exports")
    out = {}
    for flavor in FLAVORS:
        out[flavor] = base / flavor
        assert export(str(trained[flavor]), str(out[flavor]), dtype="float32", format="hybridtitan") == "hybridtitan"
    return out


def ours(dump: Path):
    from hybridtitan.checkpoint import load_model

    return load_model(str(dump), "cpu", torch.float32)[0].eval()


def tokens(shape, seed=0):
    return torch.randint(5, 8000, shape, generator=torch.Generator().manual_seed(seed))


_loaded: dict[str, types.ModuleType] = {}


def remote_module(folder: Path) -> types.ModuleType:
    """The folder's modeling_hybridtitan, imported by path as a package of its own (its relative imports resolve
    inside the folder)."""
    name = f"standalone_{len(_loaded)}"
    if str(folder) not in _loaded:
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
        _loaded[str(folder)] = importlib.import_module(f"{name}.modeling_hybridtitan")
    return _loaded[str(folder)]


def load(folder: Path, **kwargs):
    mod = remote_module(folder)
    model, info = mod.HybridTitanForCausalLM.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval(), mod


def cache_of(out):
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def reference_greedy(ref, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """HybridLM's own greedy decode with its InferenceCache (one token a step after the prompt)."""
    from hybridtitan.models import InferenceCache

    cache = InferenceCache(len(ref.layers))
    seq, step = prompt, prompt
    with torch.no_grad():
        for _ in range(new):
            step = ref(step, cache=cache)[:, -1:].argmax(-1)
            seq = torch.cat([seq, step], dim=1)
    return seq


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


# ------------------------------------------------------------------------------------------ the code itself


def _without_imports(tree: ast.AST) -> str:
    class Drop(ast.NodeTransformer):
        def visit_Import(self, node):
            return None

        visit_ImportFrom = visit_Import

    return ast.dump(Drop().visit(tree))


def test_the_export_carries_the_packages_code(exports):
    """Every file of the folder's code is a module of the package, its imports of hybridtitan made relative to the
    folder's other files and nothing else changed; auto_map names the entry points, whose top-level imports are
    torch, transformers, the standard library and the folder's files. No file imports hybridtitan by name."""
    from hybridtitan.hf.configuration import AUTO_MAP
    from hybridtitan.hf.remote import FILES, FLAT, MODULES, flat_source, module_name

    for folder in exports.values():
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "hybridtitan" and config["auto_map"] == AUTO_MAP and config["model_args"]
        assert sorted(p.name for p in folder.glob("*.py")) == sorted(FILES)
        for path in MODULES:
            assert (folder / f"{FLAT[module_name(path)]}.py").read_text().startswith(flat_source(path)), path
    for path in MODULES:  # the rewriting changes imports only
        original, flat = ast.parse((REPO / "hybridtitan" / path).read_text()), ast.parse(flat_source(path))
        assert _without_imports(original) == _without_imports(flat), path
    folder = next(iter(exports.values()))
    for name in FILES:
        tree = ast.parse((folder / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert node.module.split(".")[0] != "hybridtitan", f"{name}:{node.lineno}"
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "hybridtitan" for a in node.names), f"{name}:{node.lineno}"
        if name in AUTO_MAP.values() or name.removesuffix(".py") in {v.split(".")[0] for v in AUTO_MAP.values()}:
            top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            roots = {"." if getattr(n, "level", 0) else (n.module if isinstance(n, ast.ImportFrom) else
                                                         n.names[0].name).split(".")[0] for n in top}
            assert roots <= {"torch", "transformers", "."} | STDLIB, (name, roots)


# ------------------------------------------------------------------------------------------ in this process


@pytest.mark.parametrize("flavor", FLAVORS)
def test_logits_decode_and_greedy_match_hybridlm(flavor, trained, exports):
    hf, mod = load(exports[flavor])
    ref = ours(trained[flavor])
    # 100 tokens: past a GDN/Mamba2 chunk (64) and several KDA chunks (16)
    x = tokens((2, 100))
    with torch.no_grad():
        expected = ref(x)
        torch.testing.assert_close(hf(x).logits, expected, atol=1e-5, rtol=0)
        # prefill 90 tokens with a cache, then one token per call
        out = hf(x[:, :90], use_cache=True)
        cache = cache_of(out)
        assert isinstance(cache, mod.HybridCache) and cache.get_seq_length() == 90
        steps = [out.logits] + [hf(x[:, t:t + 1], past_key_values=cache).logits for t in range(90, 100)]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=0)
        assert cache.get_seq_length() == 100

    prompt, new = tokens((1, 9), seed=1), 12
    seen = []
    hook = hf.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    generated = hf.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=True)
    hook.remove()
    assert seen == [9] + [1] * (new - 1), seen  # the cache is used: one token per step
    assert torch.equal(generated, reference_greedy(ref, prompt, new))


def test_generate_batched_and_without_cache(trained, exports):
    hf, _ = load(exports["debug_hybrid"])
    ref = ours(trained["debug_hybrid"])
    prompts = tokens((3, 7), seed=2)
    with_cache = hf.generate(prompts, max_new_tokens=5, do_sample=False, use_cache=True)
    without = hf.generate(prompts, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(with_cache, without)
    assert torch.equal(with_cache, reference_greedy(ref, prompts, 5))
    # beam search reorders the cache (reorder_cache / batch_repeat_interleave): the same beams as without it
    beams = dict(max_new_tokens=4, num_beams=3, do_sample=False)
    assert torch.equal(hf.generate(prompts[:1], use_cache=True, **beams),
                       hf.generate(prompts[:1], use_cache=False, **beams))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_left_padded_batches_decode_as_each_prompt_alone(flavor, trained, exports):
    """A batch of prompts of other lengths, left-padded as generate() expects: the greedy tokens of each row are
    those of its prompt alone (no pad enters a recurrent state, a convolution window or attention), with the cache
    and, beam search, reordering it."""
    hf, _ = load(exports[flavor])
    ref = ours(trained[flavor])
    prompts = [tokens((1, n), seed=n)[0] for n in (3, 11, 6)]
    ids, mask = left_padded(prompts)
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for row, prompt in zip(out, prompts):
        assert torch.equal(row[-6:], reference_greedy(ref, prompt[None], 6)[0, -6:])
    beams = dict(max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
    both = hf.generate(input_ids=ids[:2], attention_mask=mask[:2], **beams)
    for row, prompt in zip(both, prompts[:2]):
        assert torch.equal(row[-3:], hf.generate(input_ids=prompt[None], **beams)[0, -3:])


def test_hidden_states_loss_and_outputs_match_hybridtitan_classes(exports):
    """What hybridtitan's own Hugging Face class gives, given by the standalone one too."""
    from hybridtitan.hf import HybridTitanForCausalLM

    folder = exports["debug_hybrid"]
    hf, _ = load(folder)
    own = HybridTitanForCausalLM.from_pretrained(str(folder)).eval()
    x = tokens((2, 20))
    with torch.no_grad():
        a, b = hf(x, output_hidden_states=True), own(x, output_hidden_states=True)
        assert len(a.hidden_states) == hf.config.num_hidden_layers + 1
        for sa, sb in zip(a.hidden_states, b.hidden_states, strict=True):
            torch.testing.assert_close(sa, sb, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.hidden_states[0], hf.model.embeddings(x))
        assert hf(x).hidden_states is None
        as_tuple = hf(x, use_cache=False, return_dict=False)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == 1 and torch.equal(as_tuple[0], a.logits)
        torch.testing.assert_close(hf(x, logits_to_keep=3).logits, a.logits[:, -3:])
        assert hf(x, logits_to_keep=1).logits.shape == (2, 1, hf.config.vocab_size)

    # the loss, and the micro-batch sum with num_items_in_batch (transformers' Trainer) as in the whole batch
    hf.train()
    own.train()
    labels = x.clone()
    labels[0, 5:] = -100
    loss = hf(x, labels=labels).loss
    torch.testing.assert_close(loss, own(x, labels=labels).loss, atol=1e-5, rtol=1e-5)
    loss.backward()
    whole = {n: p.grad.clone() for n, p in hf.named_parameters()}
    hf.zero_grad()
    count = (labels[:, 1:] != -100).sum()
    for rows in (slice(0, 1), slice(1, 2)):
        hf(x[rows], labels=labels[rows], num_items_in_batch=count).loss.backward()
    for n, p in hf.named_parameters():
        torch.testing.assert_close(p.grad, whole[n], atol=1e-5, rtol=1e-4)
    # and the same gradients as hybridtitan's class
    own(x, labels=labels).loss.backward()
    theirs = dict(own.named_parameters())
    for n, p in hf.named_parameters():
        torch.testing.assert_close(p.grad, theirs[n].grad, atol=1e-5, rtol=1e-4)


def test_padding_and_cache_api(exports):
    hf, mod = load(exports["debug_hybrid"])
    x = tokens((2, 7))
    mask = torch.tensor([[1] * 4 + [0] * 3, [1] * 7])
    with torch.no_grad():
        out = hf(x, attention_mask=mask)  # right padding, scoring: right without a cache
        assert cache_of(out) is None
        torch.testing.assert_close(out.logits[:1, :4], hf(x[:1, :4]).logits, atol=1e-5, rtol=0)
        # left padding: each row's real tokens as if alone, the pads' logits zero
        left = hf(x, attention_mask=mask.flip(1)).logits
        torch.testing.assert_close(left[:1, 3:], hf(x[:1, 3:]).logits, atol=1e-5, rtol=0)
        assert not left[0, :3].any()
        with pytest.raises(ValueError, match="right-padded"):
            hf(x, attention_mask=mask, use_cache=True)

    with torch.no_grad():
        cache = cache_of(hf(x, use_cache=True))
        assert isinstance(cache, mod.HybridCache) and cache.batch_size == 2 and len(cache) == 8
        latents = [s for s in cache.inner.layers if "c_kv" in s]
        assert latents and latents[0]["c_kv"].shape[:2] == (2, 7)  # MLA caches its latent, not K and V
        assert any(s.get("recurrent") is not None and s["recurrent"].dtype == torch.float32 for s in cache.inner.layers)
        cache.reorder_cache(torch.tensor([1, 0]))
        step = hf(torch.full((2, 1), 42), past_key_values=cache).logits
        full = hf(torch.cat([x[[1, 0]], torch.full((2, 1), 42)], dim=1)).logits[:, -1:]
        torch.testing.assert_close(step, full, atol=1e-5, rtol=0)
        cache.batch_repeat_interleave(2)
        assert cache.batch_size == 4
        cache.crop(cache.get_seq_length())  # a no-op is fine
        with pytest.raises(NotImplementedError):
            cache.crop(3)
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.batch_size == -1


def test_resize_save_and_load_again(exports, tmp_path):
    """A model saved again (fine-tuning) keeps a folder that loads the same way: both files, auto_map, the new
    vocabulary in model_args."""
    from hybridtitan.hf.configuration import AUTO_MAP
    from hybridtitan.hf.remote import FILES

    hf, _ = load(exports["debug_mamba2"])
    x = tokens((1, 12))
    with torch.no_grad():
        before = hf(x).logits
    hf.resize_token_embeddings(8200)
    hf.save_pretrained(tmp_path / "resized")
    config = json.loads((tmp_path / "resized" / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["model_args"]["vocab_size"] == config["vocab_size"] == 8200
    assert sorted(p.name for p in (tmp_path / "resized").glob("*.py")) == sorted(FILES)
    for name in FILES:  # the folder's own code, copied as it is
        assert (tmp_path / "resized" / name).read_bytes() == (exports["debug_mamba2"] / name).read_bytes(), name
    again, _ = load(tmp_path / "resized")
    assert again.get_input_embeddings().weight.shape[0] == 8200
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits[..., :before.shape[-1]], before, atol=1e-5, rtol=0)


def test_activation_checkpointing(exports):
    hf, _ = load(exports["debug_hybrid"])
    hf.train()
    x = tokens((2, 16))

    def loss_and_grads():
        hf.zero_grad()
        loss = hf(x, labels=x).loss
        loss.backward()
        # (the checkpoint wrappers add a level to the parameters' names, not to the state dict's)
        return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                               for n, p in hf.named_parameters()}

    plain_loss, plain = loss_and_grads()
    enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
    disable = getattr(hf, "activation_checkpointing_disable", None) or hf.gradient_checkpointing_disable
    enable()
    # transformers 5.24 renamed is_gradient_checkpointing (a deprecated alias now)
    is_on = getattr(type(hf), "is_activation_checkpointing", None) or type(hf).is_gradient_checkpointing
    wrapped = [hasattr(layer, "_checkpoint_wrapped_module") for layer in hf.model.layers]
    assert is_on.fget(hf) and all(wrapped)
    calls = []
    hooks = [layer._checkpoint_wrapped_module.register_forward_pre_hook(lambda *a: calls.append(1))
             for layer in hf.model.layers]
    loss, grads = loss_and_grads()
    assert len(calls) == 2 * len(hf.model.layers)  # each sublayer ran again in the backward pass
    for h in hooks:
        h.remove()
    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=1e-6)
    for n in plain:
        torch.testing.assert_close(grads[n], plain[n], atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        cache = cache_of(hf(x[:, :8], use_cache=True))
    with pytest.raises(ValueError, match="activation checkpointing"):
        hf(x[:, 8:], past_key_values=cache)
    disable()
    assert not is_on.fget(hf) and not any(hasattr(layer, "_checkpoint_wrapped_module") for layer in hf.model.layers)


def test_fresh_init_and_bfloat16(exports, trained):
    from hybridtitan.hf import HybridTitanForCausalLM

    folder = exports["debug_kda"]
    mod = remote_module(folder)
    fresh = mod.HybridTitanForCausalLM(mod.HybridTitanConfig.from_pretrained(str(folder))).eval()
    assert all(torch.isfinite(p).all() for p in fresh.parameters())
    assert bool((fresh.model.layers[0].mixer.A_log.exp() >= 1).all())  # the mixer's own init ran
    x = tokens((1, 40))
    with torch.no_grad():
        assert torch.isfinite(fresh(x).logits).all()
        # bf16: no further from float32 than hybridtitan's own class in bf16 (both round, in other orders)
        exact = ours(trained["debug_kda"])(x)
        ours_bf16 = load(folder, dtype=torch.bfloat16)[0](x).logits
        theirs = HybridTitanForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()(x).logits
    assert (ours_bf16 - exact).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-3


# ------------------------------------------------------------------------------------------ a fresh environment

CHILD = r"""
import importlib.util, json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out = sys.argv[1]
results = {"importable": {m: importlib.util.find_spec(m) is not None for m in ("hybridtitan", "fla")}}
tensors = {}
for name, folder in json.loads(sys.argv[2]).items():
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    x = torch.load(f"{out}/inputs.pt")
    with torch.no_grad():
        tensors[name + ".logits"] = model(x["logits"]).logits
    tensors[name + ".generated"] = model.generate(x["prompt"], max_new_tokens=12, do_sample=False, use_cache=True)
    tensors[name + ".padded"] = model.generate(input_ids=x["padded"], attention_mask=x["mask"], max_new_tokens=6,
                                               do_sample=False, pad_token_id=0)
    ids = tok("hello world")["input_ids"]
    from transformers import PreTrainedTokenizerFast
    assert PreTrainedTokenizerFast.from_pretrained(folder)("hello world")["input_ids"] == ids  # no flag, no question
    results[name] = {"class": type(model).__module__ + "." + type(model).__name__, "dtype": str(model.dtype),
                     "tokens": ids, "text": tok.decode(ids)}
torch.save(tensors, f"{out}/tensors.pt")
with open(f"{out}/results.json", "w") as f:
    json.dump(results, f)
"""


def _make_venv(path: Path) -> Path:
    """A venv with torch (this environment's CPU build: tests/venvs.py; pip installs its dependencies), transformers
    and safetensors at the versions of constraints-cpu.txt. Nothing of the repository's."""
    python = make_venv(path)
    pip_install(python, "-c", "constraints-cpu.txt", "torch==2.13.0", "transformers", "safetensors", timeout=900)
    return python


@pytest.fixture(scope="module")
def standalone_python(tmp_path_factory) -> Path:
    given = os.environ.get("HYBRIDTITAN_STANDALONE_PYTHON")
    return Path(given) if given else _make_venv(tmp_path_factory.mktemp("standalone_venv") / "venv")


def test_loads_in_fresh_environment_with_transformers_alone(standalone_python, trained, exports, tmp_path):
    flavors = ("debug_hybrid", "debug_mamba2")
    prompts = [tokens((1, n), seed=n)[0] for n in (4, 10)]
    padded, mask = left_padded(prompts)
    inputs = {"logits": tokens((2, 80)), "prompt": tokens((1, 9), seed=1), "padded": padded, "mask": mask}
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    env["PATH"] = f"{standalone_python.parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        [str(standalone_python), "-c", CHILD, str(tmp_path), json.dumps({f: str(exports[f]) for f in flavors})],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # cwd: not the repository
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # trust_remote_code on both: no question asked, the folder's own config class used (no model-type warning)
    assert "to instantiate a model of type" not in proc.stderr and "[y/N]" not in proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    tensors = torch.load(tmp_path / "tensors.pt")
    assert results["importable"] == {"hybridtitan": False, "fla": False}

    from transformers import AutoTokenizer

    for flavor in flavors:
        got = results[flavor]
        # transformers' module cache of the folder's code, not a class of hybridtitan's
        assert got["class"].startswith("transformers_modules.") and got["class"].endswith(
            "modeling_hybridtitan.HybridTitanForCausalLM"), got["class"]
        assert got["dtype"] == "torch.float32"
        tok = AutoTokenizer.from_pretrained(str(exports[flavor]))
        assert got["tokens"] == tok("hello world")["input_ids"] and got["text"] == tok.decode(got["tokens"])
        ref = ours(trained[flavor])
        with torch.no_grad():
            expected = ref(inputs["logits"])
        torch.testing.assert_close(tensors[f"{flavor}.logits"], expected, atol=1e-5, rtol=0)
        assert torch.equal(tensors[f"{flavor}.generated"], reference_greedy(ref, inputs["prompt"], 12))
        for row, prompt in zip(tensors[f"{flavor}.padded"], prompts):
            assert torch.equal(row[-6:], reference_greedy(ref, prompt[None], 6)[0, -6:])
