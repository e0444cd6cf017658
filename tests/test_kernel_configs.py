"""Tuned kernel configurations (hybridtitan.ops.kernel_configs, python -m hybridtitan.tune): a folder in FLA's format
recorded from the autotuner's real choices, read back through FLA's own cache so that no kernel autotunes where the
folder holds its shape, and refused in one line (exit 2, nothing written) when malformed or another machine's.

On CPUs Triton's launches run as a dry run (gpu_harness/rocm/triton_recorder.py: the binder, the heuristics and the
autotuner run on CPU tensors for an sm_90 target, nothing is compiled or launched), which is enough to see which
configurations a kernel would compile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers import QUICK, RECIPE, ROOT, env, main_error
from hybridtitan.ops import kernel_configs as kc

GPU = {"name": "NVIDIA H200", "dir": "NVIDIA_H200", "capability": "9.0"}

# an autotuned kernel of two configurations, in a module of its own so that a process can define it after
# activating a folder (as FLA's kernels are defined at FLA's import)
KERNEL_MODULE = '''
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 128}, num_warps=2), triton.Config({"BLOCK": 256}, num_warps=4)],
                 key=["n"])
@triton.jit
def doubled_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)


def launch(n):
    import torch

    x = torch.randn(n)
    y = torch.empty_like(x)
    doubled_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
'''


def run_python(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (FLA must not be imported before activation), with the test kernel's
    module and the GPU harness on its path."""
    (tmp_path / "doubled.py").write_text(KERNEL_MODULE)
    environ = env()
    environ["PYTHONPATH"] = f"{tmp_path}:{ROOT / 'gpu_harness' / 'rocm'}:{environ['PYTHONPATH']}"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def write_folder(path: Path, kernels: dict, gpu=GPU, versions=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    versions = versions or kc.these_versions()
    (path / kc.RECORD).write_text(json.dumps({"format": kc.FORMAT, "gpu": gpu, "versions": versions,
                                              "recorded": []}))
    for name, entries in kernels.items():
        (path / f"{name}.json").write_text(json.dumps({"autotune_entries": {
            kc.key_hash(key): {"autotune_key": key, "config": config} for key, config in entries}}))
    return path


def config(block: int, warps: int) -> dict:
    return {"kwargs": {"BLOCK": block}, "num_warps": warps, "num_stages": 3, "num_ctas": 1}


def test_recorded_choices_read_back_through_flas_cache(tmp_path):
    """Recording: the autotuner's choice for each key, filed as FLA files it (FLA's own loader finds it under the
    same key). Reading: in a process that activates a folder before FLA and the kernel are defined, every one of
    FLA's autotuned kernels is FLA's CachedAutotuner, and the test kernel compiles the folder's configuration
    only (no other candidate is benchmarked): at the recorded key, and at a key of another length (fuzzy)."""
    out = tmp_path / "recorded"
    run_python(f'''
        import json
        from triton_recorder import record_triton_kernels
        from hybridtitan.ops import kernel_configs as kc
        import doubled

        with record_triton_kernels(dry_run="sm_90", keep_candidates=True) as rec:
            doubled.launch(1024)
        assert len(rec.kernels) == 2  # both candidates compiled: it autotuned
        written = kc.save_choices({str(out)!r}, {GPU!r}, {{"recipe": "test"}})
        assert written == {{"doubled_kernel": 1}}, written
        kc.save_choices({str(out)!r}, {GPU!r}, {{"recipe": "again"}})  # merged: the same key, once
    ''', tmp_path)
    folder = kc.read_folder(str(out))
    assert [r["recipe"] for r in folder.record["recorded"]] == ["test", "again"]
    assert folder.record["gpu"] == GPU and folder.record["versions"]["triton"] == kc.these_versions()["triton"]
    entries = folder.kernels["doubled_kernel"]["autotune_entries"]
    (entry,) = entries.values()
    assert entry["autotune_key"] == [1024, "torch.float32", "torch.float32"]  # n, then the tensors' dtypes
    assert entry["config"]["kwargs"] == {"BLOCK": 128}  # a dry run's timings are equal: the first config

    # FLA's own lookup of that file, for the key Triton builds
    run_python(f'''
        import os
        os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"] = {str(out)!r}, "strict"
        from hybridtitan.ops.kernel_configs import _fla_cache_module
        cache = _fla_cache_module()
        found = cache.load_cached_config("doubled_kernel", cache.AutotuneKey((1024, "torch.float32", "torch.float32")))
        assert found["kwargs"] == {{"BLOCK": 128}} and found["num_warps"] == 2, found
    ''', tmp_path)

    # a folder whose choice differs from what autotuning would pick, read through FLA's cache
    chosen = write_folder(tmp_path / "chosen", {"doubled_kernel": [([1024, "torch.float32", "torch.float32"],
                                                                      config(256, 4))]})
    proc = run_python(f'''
        import sys
        import torch
        from hybridtitan.ops import kernel_configs as kc

        choice = kc.choose({str(chosen)!r}, torch.device("cpu"))
        kc.activate(choice)
        import fla  # noqa: F401  (every kernel of FLA's is defined now)
        from triton_recorder import record_triton_kernels
        import doubled

        cache = sys.modules["fla.ops.utils.cache"]
        tuners = kc.autotuners()
        assert len(tuners) > 100 and all(isinstance(a, cache.CachedAutotuner) for a in tuners), len(tuners)
        for n in (1024, 3000):  # the recorded key, and one that takes it through the fuzzy match
            with record_triton_kernels(dry_run="sm_90", keep_candidates=True) as rec:
                doubled.launch(n)
            assert [(r["constexprs"]["BLOCK"], r["options"]["num_warps"]) for r in rec.kernels] == [(256, 4)], \\
                rec.kernels
        assert kc.autotuned_here(choice) == []
        print(choice.message)
    ''', tmp_path)
    assert "1 recorded shapes of 1 kernels" in proc.stdout and "no GPU here: read and checked" in proc.stdout


def test_autotuned_here_names_the_kernels_without_a_recorded_shape(tmp_path):
    """A key of another structure (here: other dtypes) matches nothing: the kernel autotunes, and the trainer's
    log names it."""
    folder = write_folder(tmp_path / "f", {"doubled_kernel": [([1024, "torch.float16", "torch.float16"],
                                                                config(256, 4))]})
    run_python(f'''
        import torch
        from hybridtitan.ops import kernel_configs as kc
        from triton_recorder import record_triton_kernels

        choice = kc.choose({str(folder)!r}, torch.device("cpu"))
        kc.activate(choice)
        import doubled

        with record_triton_kernels(dry_run="sm_90", keep_candidates=True) as rec:
            doubled.launch(1024)
        assert len(rec.kernels) == 2  # both candidates: it autotuned
        # a dead weakref.proxy among the process' objects (torch leaves some) is passed over, not dereferenced
        import weakref
        class Gone: pass
        gone = Gone(); dead = weakref.proxy(gone); del gone
        assert kc.autotuned_here(choice) == ["doubled_kernel (doubled)"], kc.autotuned_here(choice)
    ''', tmp_path)


def test_activation_after_fla_is_imported_is_refused(tmp_path):
    folder = write_folder(tmp_path / "f", {})
    run_python(f'''
        import torch
        import fla  # noqa: F401
        from hybridtitan.ops import kernel_configs as kc

        try:
            kc.activate(kc.choose({str(folder)!r}, torch.device("cpu")))
        except RuntimeError as e:
            assert "before FLA is imported" in str(e)
        else:
            raise AssertionError("activated after FLA's import")
    ''', tmp_path)


def test_choose_autotune_and_shipped_without_a_gpu():
    cpu = torch.device("cpu")
    assert kc.choose("autotune", cpu).folder is None
    shipped = kc.choose("shipped", cpu)
    assert shipped.folder is None and "no GPU" in shipped.message


def _bad_folders(tmp_path: Path):
    good_key = [64, "torch.bfloat16"]
    yield "missing", tmp_path / "nowhere", "no such folder"
    empty = tmp_path / "empty"
    empty.mkdir()
    yield "no record", empty, "no record.json"
    bad_record = write_folder(tmp_path / "bad_record", {})
    (bad_record / kc.RECORD).write_text('{"format": 99}')
    yield "record of another format", bad_record, "not a record of format 1"
    not_json = write_folder(tmp_path / "not_json", {})
    (not_json / "k.json").write_text("{")
    yield "a kernel file that is not JSON", not_json, "k.json: unreadable"
    not_fla = write_folder(tmp_path / "not_fla", {})
    (not_fla / "k.json").write_text('{"best_config": {}}')
    yield "not FLA's format", not_fla, "needs an 'autotune_entries' mapping"
    wrong_hash = write_folder(tmp_path / "wrong_hash", {})
    (wrong_hash / "k.json").write_text(json.dumps({"autotune_entries": {
        "0" * 32: {"autotune_key": good_key, "config": config(64, 4)}}}))
    yield "an entry under another hash", wrong_hash, "filed under another hash"
    no_warps = write_folder(tmp_path / "no_warps", {"k": [(good_key, {"kwargs": {}, "num_stages": 2})]})
    yield "a config without num_warps", no_warps, "positive integer 'num_warps'"
    versions = dict(kc.these_versions(), triton="0.0.1")
    yield "another Triton", write_folder(tmp_path / "other_triton", {}, versions=versions), \
        "another machine's configurations (recorded with triton 0.0.1"


def test_bad_folders_are_refused_in_one_line(tmp_path):
    for what, path, expected in _bad_folders(tmp_path):
        with pytest.raises(kc.KernelConfigError) as e:
            kc.choose(str(path), torch.device("cpu"))
        assert expected in str(e.value) and "\n" not in str(e.value), (what, str(e.value))


def test_foreign_compares_the_gpu_and_the_versions():
    versions = kc.these_versions()
    record = {"gpu": GPU, "versions": versions}
    assert kc.foreign(record, GPU, versions) is None
    assert kc.foreign(record, None, versions) is None  # no GPU: the versions alone
    mi300 = {"name": "AMD Instinct MI300X", "dir": "AMD_Instinct_MI300X", "capability": "gfx942"}
    assert "recorded on NVIDIA H200" in kc.foreign(record, mi300, versions)
    assert "recorded with fla" in kc.foreign(record, GPU, dict(versions, fla="0.1"))
    assert kc.foreign(record, GPU, dict(versions, torch="9.9")) is None  # torch is recorded, not compared
    assert kc.gpu_dir_name("NVIDIA H200") == "NVIDIA_H200" and kc.gpu_dir_name("AMD Instinct MI300X") == \
        "AMD_Instinct_MI300X"


def test_the_trainer_refuses_a_bad_folder_before_writing_anything(tmp_path, capsys):
    dump = tmp_path / "run"
    bad = write_folder(tmp_path / "other", {}, versions=dict(kc.these_versions(), fla="0.1"))
    code, err = main_error(capsys, ["--job.config_file", RECIPE, *QUICK, "--job.dump_folder", str(dump),
                                    "--training.kernel_configs", str(bad)])
    assert code == 2 and err.startswith("error: training.kernel_configs") and "recorded with fla 0.1" in err
    assert len(err.splitlines()) == 1 and not dump.exists()
    code, err = main_error(capsys, ["--job.config_file", RECIPE, "--training.kernel_configs", " "])
    assert code == 2 and "training.kernel_configs must be shipped, autotune or a folder's path" in err


def test_the_trainer_says_which_configurations_it_uses(tmp_path):
    from helpers import run_train

    folder = write_folder(tmp_path / "f", {})
    proc = run_train(tmp_path / "run", *QUICK, "--training.steps", "1", "--checkpoint.enable", "false",
                     "--training.kernel_configs", str(folder), nproc=1)
    assert f"kernel configurations: {folder} (0 recorded shapes of 0 kernels) (no GPU here" in proc.stdout


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_generate_and_eval_refuse_a_bad_folder(tmp_path, command):
    extra = ["--prompt", "x"] if command == "generate" else ["--tasks", "stdlib_mc"]
    args = [sys.executable, "-m", f"hybridtitan.{command}", "--checkpoint", str(ROOT / "tests"), *extra,
            "--device", "cpu", "--kernel_configs", str(tmp_path / "nowhere")]
    proc = subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no such folder of kernel configurations" in proc.stderr, proc.stderr[-2000:]


def test_tune_needs_a_gpu_and_a_recipe(tmp_path, capsys):
    from hybridtitan import tune

    out = tmp_path / "out"
    for argv, expected in ((["--output", str(out)], "give a recipe"),
                           (["--job.config_file", RECIPE, "--steps", "0"], "--steps must be >= 1"),
                           (["--job.config_file", RECIPE, "--output", str(out)], "no GPU")):
        with pytest.raises(SystemExit) as e:
            tune.main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_tune_reads_every_recipe_without_its_data():
    """Tuning runs on mock tokens: a recipe whose shards are not on this machine still gives its shapes."""
    from hybridtitan.config_manager import ConfigError, parse_config
    from hybridtitan.tune import RECIPE_ONLY

    recipe = "train_configs/gdn_300M.toml"
    with pytest.raises(ConfigError, match="no Megatron .idx file"):  # its data is not here
        parse_config(["--job.config_file", str(ROOT / recipe)])
    for path in sorted((ROOT / "train_configs").rglob("*.toml")):
        cfg = parse_config(["--job.config_file", str(path)] + RECIPE_ONLY)
        assert cfg.data.source == "mock" and cfg.training.seq_len > 0, path


def test_shipped_folders_are_well_formed():
    """Each folder the package ships is read by the same checks as a user's, and named for its GPU."""
    for folder in sorted(p for p in kc.SHIPPED.iterdir() if p.is_dir()):
        record = kc.read_folder(str(folder)).record
        assert record["gpu"]["dir"] == folder.name, folder


def test_a_time_box_is_not_swallowed_by_an_except_exception():
    from hybridtitan import tune

    with pytest.raises(tune.Stopped):
        try:  # as a kernel's autotuning loop that passes over a config that failed
            tune._stop(signal.SIGTERM, None)
        except Exception:
            pass


def test_a_time_box_records_what_was_tuned_whatever_error_the_stop_became():
    """SIGTERM inside torch.compile's compiling surfaces as the compiler's own error: still a stop, not a crash."""
    from hybridtitan import tune

    def compiling():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        except BaseException as error:
            raise RuntimeError("BackendCompilerFailed") from error

    assert tune.ran_to_the_end(lambda: None)
    assert not tune.ran_to_the_end(compiling)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(ValueError):  # an error of its own, without a SIGTERM, is raised as it is
        tune.ran_to_the_end(lambda: int("x"))
