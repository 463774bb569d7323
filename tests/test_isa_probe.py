"""functrain.compile.isa_probe: inductor's vector-ISA check runs once per environment, not once per process or
per inductor cache directory."""

from __future__ import annotations

import importlib
import json
import platform

import pytest
import torch

from functrain.compile import isa_probe as _isa_probe

jit_module = importlib.import_module("functrain.jit")  # the module, not the function functrain exports
backend_module = importlib.import_module("functrain.compile.backend")  # where jit's inductor options are made

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="inductor's x86 ISA check (other CPUs keep inductor's own)"
)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Empty inductor and functrain cache directories, no verdict yet in this process, and a counted
    torch check that reports every claimed ISA as loadable (``checks`` counts its calls)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "functrain"))
    monkeypatch.setattr(_isa_probe, "_verified", None)
    from torch._inductor import cpu_vec_isa

    checks = []
    claimed = _isa_probe._environment()
    assert claimed is not None, "this x86-64 CPU claims no vector ISA inductor knows"
    passing = [isa for isa in cpu_vec_isa.supported_vec_isa_list if str(isa) in claimed["isas"]]

    builds = []  # the ISA build-and-load probes that ran (torch's check_build, faked)

    def check_build(isa, code):
        builds.append((str(isa), code))
        return True

    def torch_check():
        checks.append(1)
        for isa in fresh.passing:
            isa.check_build("an extension's probe")  # as VecAVX512VNNI.__bool__ does, past vec_isa_ok
        return list(fresh.passing)

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", check_build)  # restored with the wrapper
    fresh.builds = builds

    fresh.passing = passing
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", torch_check)
    fresh.checks = checks
    fresh.environment = claimed
    fresh.record = _isa_probe._record_path(claimed)
    assert fresh.record.parent == tmp_path / "functrain"
    return fresh


def _new_process(monkeypatch):
    monkeypatch.setattr(_isa_probe, "_verified", None)


def test_the_check_runs_once_and_a_later_process_reads_the_record(fresh, monkeypatch):
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 1
    assert json.loads(fresh.record.read_text())["isas"] == [str(isa) for isa in fresh.passing]
    assert _isa_probe.vec_isa_verified() is True and len(fresh.checks) == 1  # once per process
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 1  # the record stood in for torch's check


def test_the_extension_probes_are_answered_from_the_record_in_a_later_process(fresh, monkeypatch):
    # cpp.vec_isa_ok=True skips only the base check: the bf16/VNNI/AMX probes still build and load.
    assert _isa_probe.vec_isa_verified() is True
    probes = len(fresh.passing)
    assert len(fresh.builds) == probes and len(json.loads(fresh.record.read_text())["builds"]) == probes
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    isa = fresh.passing[0]
    assert isa.check_build("an extension's probe") is True
    assert len(fresh.builds) == probes  # answered from the record: no build, no child Python


def test_a_probe_the_record_does_not_hold_runs_torchs_check(fresh, monkeypatch):
    from torch._inductor import cpu_vec_isa

    assert _isa_probe.vec_isa_verified() is True
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    probes = len(fresh.builds)
    isa = fresh.passing[0]
    isa.check_build("other probe code")
    assert fresh.builds[probes:] == [(str(isa), "other probe code")]
    # another compiler (inductor's build fingerprint) is another key: torch's check runs
    fingerprint = cpu_vec_isa._get_isa_dry_compile_fingerprint
    monkeypatch.setattr(
        cpu_vec_isa, "_get_isa_dry_compile_fingerprint", lambda flags: "g++ 99=" + fingerprint(flags)
    )
    isa.check_build("an extension's probe")
    assert fresh.builds[probes + 1 :] == [(str(isa), "an extension's probe")]


def test_a_record_without_build_verdicts_is_checked_again_once(fresh, monkeypatch):
    assert _isa_probe.vec_isa_verified() is True
    record = json.loads(fresh.record.read_text())
    fresh.record.write_text(json.dumps({k: v for k, v in record.items() if k != "builds"}))  # older format
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 2 and json.loads(fresh.record.read_text())["builds"]
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 2


def test_a_recorded_failure_is_answered_as_a_failure(fresh, monkeypatch):
    assert _isa_probe.vec_isa_verified() is True
    record = json.loads(fresh.record.read_text())
    fresh.record.write_text(json.dumps({**record, "builds": {k: False for k in record["builds"]}}))
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert fresh.passing[0].check_build("an extension's probe") is False


def test_a_new_inductor_cache_directory_reads_the_same_record(fresh, monkeypatch, tmp_path):
    # A cold start (empty inductor cache: a fresh container, a wiped /tmp) would rebuild every ISA's
    # probe library (~7 s here) without the record.
    assert _isa_probe.vec_isa_verified() is True
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "another-inductor-cache"))
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 1


def test_records_of_two_environments_live_side_by_side(fresh, monkeypatch):
    assert _isa_probe.vec_isa_verified() is True
    other = {**fresh.environment, "python": "/another/venv/bin/python"}
    monkeypatch.setattr(_isa_probe, "_environment", lambda: other)
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 2
    assert sorted(fresh.record.parent.iterdir()) == sorted([fresh.record, _isa_probe._record_path(other)])
    monkeypatch.setattr(_isa_probe, "_environment", lambda: fresh.environment)
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 2  # the first environment's record is still there


def test_a_directory_that_cannot_be_written_keeps_the_verdict_for_this_process(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(blocker / "functrain"))  # mkdir fails, even as root
    assert _isa_probe.vec_isa_verified() is True
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 2  # nothing was recorded: the next process checks again


def test_the_cache_directory_follows_functrain_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "ft"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _isa_probe.cache_root() == tmp_path / "ft"
    monkeypatch.delenv("FUNCTRAIN_CACHE_DIR")
    assert _isa_probe.cache_root() == tmp_path / "xdg" / "functrain"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _isa_probe.cache_root() == tmp_path / "home" / ".cache" / "functrain"


def test_a_record_from_another_environment_is_checked_again(fresh, monkeypatch):
    assert _isa_probe.vec_isa_verified() is True
    record = json.loads(fresh.record.read_text())
    fresh.record.write_text(json.dumps({**record, "torch": "another build"}))
    _new_process(monkeypatch)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 2
    assert json.loads(fresh.record.read_text())["torch"] == torch.version.git_version


@pytest.mark.parametrize("content", ["{not json", "[]"])
def test_a_damaged_record_is_checked_again(fresh, monkeypatch, content):
    fresh.record.parent.mkdir(parents=True)
    fresh.record.write_text(content)
    assert _isa_probe.vec_isa_verified() is True
    assert len(fresh.checks) == 1
    assert json.loads(fresh.record.read_text())["isas"]


def test_an_isa_that_fails_torchs_check_leaves_the_check_to_inductor(fresh):
    fresh.passing = fresh.passing[1:]  # the best claimed ISA failed to build or load
    assert _isa_probe.vec_isa_verified() is False
    assert not fresh.record.exists()


def test_other_platforms_leave_the_check_to_inductor(fresh, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert _isa_probe.vec_isa_verified() is False
    assert fresh.checks == [] and not fresh.record.exists()


def test_a_moved_private_api_leaves_the_check_to_inductor(fresh, monkeypatch):
    from torch._inductor import cpu_vec_isa

    monkeypatch.delattr(cpu_vec_isa, "x86_isa_checker")
    assert _isa_probe.vec_isa_verified() is False


def _cpu_patches(monkeypatch, options=None):
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        seen.update(config_patches or {})
        return gm

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    step = jit_module.CompiledStep(lambda s, x: (s, x), options=options)
    step._backend(gm, [torch.ones(2)], config=dict(options or {}))
    return seen


def test_jit_skips_inductors_check_on_cpu_only_once_verified_and_options_win(monkeypatch):
    monkeypatch.setattr(backend_module, "vec_isa_verified", lambda: True)
    assert _cpu_patches(monkeypatch)["cpp.vec_isa_ok"] is True
    assert _cpu_patches(monkeypatch, {"cpp.vec_isa_ok": False})["cpp.vec_isa_ok"] is False
    monkeypatch.setattr(backend_module, "vec_isa_verified", lambda: False)
    assert "cpp.vec_isa_ok" not in _cpu_patches(monkeypatch)
