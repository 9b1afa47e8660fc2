"""`python -m workbench.doctor`: each check read from stand-in inputs (device files in a temp dir, environment
variables, installed-package metadata on PYTHONPATH), never by replacing the doctor's own logic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.run_helpers import ROOT


def doctor(*args: str, dev_dir=None, extra_path=None, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "NEURON_LOGICAL_NC_CONFIG"}
    e.update(env)
    e["WORKBENCH_DEV_DIR"] = str(dev_dir or ROOT / "no-such-dev-dir")
    if extra_path:
        e["PYTHONPATH"] = os.pathsep.join([str(extra_path), str(ROOT)])
    return subprocess.run([sys.executable, "-m", "workbench.doctor", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=300)


def rows(out: str) -> dict[str, tuple[str, str]]:
    """name -> (status, rest of the line)."""
    table = {}
    for line in out.splitlines():
        status, rest = line[:4].strip(), line[6:]
        name = rest.split("  ")[0].strip()
        table[name] = (status, rest[len(name):].strip())
    return table


def trn2_host(tmp_path, chips: int = 16):
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(chips):
        (dev / f"neuron{i}").touch()
    return dev


def fake_dist(tmp_path, name: str, version: str):
    """An installed-package record as pip leaves it (metadata only): what the doctor reads for versions."""
    site = tmp_path / "site"
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def test_cpu_host_is_ready(tmp_path):
    proc = doctor("--job.config_file", "configs/cpu_dense.toml", "--job.dump_folder", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    t = rows(proc.stdout)
    assert t["python"] == ("ok", f"{sys.version_info[0]}.{sys.version_info[1]}")
    assert t["torch"][0] == "ok" and t["torch"][1].startswith("2.14.0")
    assert t["torch-neuronx"][0] == "ok" and "only needed on Trainium" in t["torch-neuronx"][1]
    assert t["neuron devices"] == ("ok", "none (not a Trainium host)")
    assert t["disk"][0] == "ok" and "one tiny checkpoint" in t["disk"][1]


def test_trn2_host_without_torch_neuronx_fails_with_fix(tmp_path):
    proc = doctor("--nproc", "64", dev_dir=trn2_host(tmp_path), NEURON_LOGICAL_NC_CONFIG="2")
    assert proc.returncode == 1
    t = rows(proc.stdout)
    assert t["torch-neuronx"][0] == "fail" and "AWS's Neuron package index" in t["torch-neuronx"][1]
    assert t["nki"][0] == "warn"
    assert t["neuron devices"][1].startswith("16 (")
    assert t["ranks per node"] == ("ok", "64 at LNC=2 (asked: 64)")
    assert t["memory per rank"] == ("ok", "24 GiB HBM")


@pytest.mark.parametrize("version, status", [("2.14.3.1.52", "ok"), ("2.13.3.0.1234", "fail")])
def test_torch_neuronx_version_against_the_support_matrix(tmp_path, version, status):
    site = fake_dist(tmp_path, "torch-neuronx", version)
    proc = doctor(dev_dir=trn2_host(tmp_path), extra_path=site, NEURON_LOGICAL_NC_CONFIG="2")
    t = rows(proc.stdout)
    assert t["torch-neuronx"] == (status, f"{version} (Neuron SDK 2.34)" if status == "ok" else t["torch-neuronx"][1])
    if status == "fail":
        assert "2.14.3.* family" in t["torch-neuronx"][1]


@pytest.mark.parametrize("lnc, status, ranks", [("1", "ok", "128 at LNC=1"), ("", "warn", "64 at LNC=2"),
                                                ("4", "fail", None)])
def test_logical_nc_config(tmp_path, lnc, status, ranks):
    proc = doctor(dev_dir=trn2_host(tmp_path), NEURON_LOGICAL_NC_CONFIG=lnc)
    t = rows(proc.stdout)
    assert t["NEURON_LOGICAL_NC_CONFIG"][0] == status
    if ranks:
        assert t["ranks per node"][1] == ranks
    else:
        assert proc.returncode == 1 and "supports 1 or 2" in t["NEURON_LOGICAL_NC_CONFIG"][1]


def test_too_many_ranks_for_the_node(tmp_path):
    proc = doctor("--nproc", "128", dev_dir=trn2_host(tmp_path), NEURON_LOGICAL_NC_CONFIG="2")
    assert rows(proc.stdout)["ranks per node"] == ("fail", "64 at LNC=2 (asked: 128)  -> use --nproc_per_node <= 64")


def test_disk_too_small_for_one_checkpoint(tmp_path):
    # 235B-A22B: ~2.8 TB per checkpoint, more than any disk this suite runs on
    proc = doctor("--job.config_file", "configs/cpu_moe.toml", "--model.flavor", "235B-A22B",
                  "--job.dump_folder", str(tmp_path))
    assert proc.returncode == 1
    status, rest = rows(proc.stdout)["disk"]
    assert status == "fail" and "one 235B-A22B checkpoint 2,8" in rest and "larger volume" in rest


@pytest.mark.parametrize("version, status, why", [("0.7.0", "ok", ""), ("0.7.3", "ok", ""),
                                                  ("0.6.0", "warn", "nl.fori_loop (NKI >= 0.6)"),
                                                  ("0.8.0", "warn", "newer NKI can remove what they use")])
def test_nki_against_the_version_the_kernels_are_written_for(tmp_path, version, status, why):
    """The kernels are written for NKI 0.7.0 (nki_emulator/version.py): 0.7.x is ok, older or newer warns why."""
    site = fake_dist(tmp_path, "nki", version)
    proc = doctor(dev_dir=trn2_host(tmp_path), extra_path=site, NEURON_LOGICAL_NC_CONFIG="2")
    got, rest = rows(proc.stdout)["nki"]
    assert got == status and rest.startswith(f"{version}; kernels written for NKI 0.7.0 (Neuron SDK 2.33)")
    assert why in rest if why else rest == f"{version}; kernels written for NKI 0.7.0 (Neuron SDK 2.33)"


def test_nki_not_installed_names_the_version_the_kernels_need(tmp_path):
    t = rows(doctor().stdout)
    assert t["nki"][0] == "ok" and "kernels written for NKI 0.7.0 (Neuron SDK 2.33)" in t["nki"][1]
    assert "CPU emulator, which models NKI 0.7.0" in t["nki"][1]


# ---- the version rules in-process, at their boundaries (the doctor's own functions, stand-in package metadata) ----


def _installed(monkeypatch, tmp_path, **versions: str) -> None:
    """Puts pip's metadata for each `dist=version` first on sys.path: what `importlib.metadata` finds first."""
    for dist, version in versions.items():
        monkeypatch.syspath_prepend(str(fake_dist(tmp_path / dist, dist.replace("_", "-"), version)))


def _rows(checks) -> dict[str, tuple[str, str, str]]:
    return {c.name: (c.status, c.value, c.fix) for c in checks}


@pytest.mark.parametrize("version, status", [("0.6.9", "warn"), ("0.7.0", "ok"), ("0.7.0+neuron", "ok"),
                                             ("0.7.99", "ok"), ("0.8.0", "warn"), ("1.7.0", "warn")])
def test_nki_row_at_the_boundary_versions(version, status):
    from workbench import doctor

    c = doctor.nki_check(version, on_neuron=True)
    assert (c.name, c.status, c.value) == ("nki", status, f"{version}; kernels written for NKI 0.7.0 (Neuron SDK 2.33)")
    if status == "ok":
        assert c.fix == ""
    else:  # older: what it lacks; newer: what it may have removed; both name the version to install
        assert ("nl.fori_loop" in c.fix) == (version < "0.7") and "install nki 0.7.x" in c.fix


@pytest.mark.parametrize("on_neuron, status", [(True, "warn"), (False, "ok")])
def test_nki_row_not_installed(on_neuron, status):
    from workbench import doctor

    c = doctor.nki_check(None, on_neuron)
    want = "not installed; kernels written for NKI 0.7.0 (Neuron SDK 2.33)"
    assert (c.name, c.status, c.value) == ("nki", status, want)
    assert ("AWS's Neuron package index" in c.fix) == on_neuron and ("CPU emulator" in c.fix) != on_neuron


@pytest.mark.parametrize("version, status, sdk", [
    ("2.14.3.0.1234", "ok", "2.33"), ("2.14.3.1.52", "ok", "2.34"),  # the matrix: SDK 2.33 and 2.34 families
    ("2.14.3.1", "ok", "2.34"), ("2.14.0.0.1", "warn", None), ("2.14.3.2.1", "warn", None),  # 2.14, not in it
    ("2.14", "fail", None), ("2.13.9", "fail", None), ("2.13.3.1.52", "fail", None),  # 2.34's PyTorch 2.13 family
    ("2.15.0", "fail", None), ("2.1.4", "fail", None)])
def test_torch_neuronx_row_at_the_boundary_versions(monkeypatch, tmp_path, version, status, sdk):
    from workbench import doctor

    _installed(monkeypatch, tmp_path, torch_neuronx=version)
    for on_neuron in (True, False):  # an installed torch-neuronx is judged the same on any host
        got = _rows(doctor.software_checks(on_neuron))["torch-neuronx"]
        assert got[:2] == (status, f"{version} (Neuron SDK {sdk})" if sdk else version)
        assert ("2.14.3.* family" in got[2]) == (status == "fail")
        assert ("not checked against (known: 2.14.3.0.* (SDK 2.33), 2.14.3.1.* (SDK 2.34))" in got[2]) == (
            status == "warn")


@pytest.mark.parametrize("on_neuron, status", [(True, "fail"), (False, "ok")])
def test_torch_neuronx_row_not_installed(on_neuron, status):
    from workbench import doctor

    got = _rows(doctor.software_checks(on_neuron))["torch-neuronx"]
    assert got[:2] == (status, "not installed")
    assert ("AWS's Neuron package index" in got[2]) == on_neuron and ("only needed on Trainium" in got[2]) != on_neuron


@pytest.mark.parametrize("version, on_neuron, status", [("2.14.0", True, "ok"), ("2.14.0+cpu", True, "ok"),
                                                        ("2.14.1", True, "fail"), ("2.13.0", False, "warn")])
def test_torch_row(monkeypatch, tmp_path, version, on_neuron, status):
    from workbench import doctor

    _installed(monkeypatch, tmp_path, torch=version)
    got = _rows(doctor.software_checks(on_neuron))["torch"]
    assert got[:2] == (status, version) and ("install torch==2.14.0" in got[2]) == (status != "ok")


@pytest.mark.parametrize("dist, version, status", [("torchtitan", "0.3.0", "ok"), ("torchtitan", "0.3.0+git1", "ok"),
                                                   ("torchtitan", "0.3.1", "warn"), ("transformers", "5.23.0", "ok"),
                                                   ("transformers", "5.22.0", "warn")])
def test_pinned_package_rows(monkeypatch, tmp_path, dist, version, status):
    from workbench import doctor

    _installed(monkeypatch, tmp_path, **{dist: version})
    got = _rows(doctor.software_checks(False))[dist]
    assert got[:2] == (status, version)
    assert got[2] == ("" if status == "ok" else f"tested with {dist}=={doctor.SUPPORT[dist]} (pyproject.toml)")


@pytest.mark.parametrize("py, status", [((3, 11), "fail"), ((3, 12), "ok"), ((3, 14), "ok"), ((3, 15), "fail")])
def test_python_row_at_the_support_matrix_bounds(monkeypatch, py, status):
    from collections import namedtuple

    from workbench import doctor

    version_info = namedtuple("version_info", "major minor micro releaselevel serial")  # sys.version_info's fields
    monkeypatch.setattr(sys, "version_info", version_info(*py, 0, "final", 0))
    got = _rows(doctor.software_checks(False))["python"]
    assert got == (status, f"{py[0]}.{py[1]}", "" if status == "ok" else
                   "use Python 3.12-3.14 (TorchNeuron release notes of Neuron 2.33.0 and "
                   "2.34.0 (support matrix))")


def test_rows_of_packages_that_are_not_installed(monkeypatch, tmp_path):
    """torch, torchtitan, transformers absent (the metadata reader finds none of them): each row fails with its fix;
    an installed nki is judged by its version in the software rows too."""
    from workbench import doctor

    _installed(monkeypatch, tmp_path, nki="0.6.2")
    found = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version",
                        lambda dist: None if dist in ("torch", "torchtitan", "transformers") else found(dist))
    rows = _rows(doctor.software_checks(on_neuron=True))
    assert rows["torch"] == ("fail", "not installed",
                             "on trn2: install torch-neuronx (it brings torch 2.14.0); elsewhere: `make setup`")
    for dist in ("torchtitan", "transformers"):
        assert rows[dist] == ("fail", "not installed", "`make setup` (or `make setup-neuron` on trn2)")
    assert rows["nki"][:2] == ("warn", "0.6.2; kernels written for NKI 0.7.0 (Neuron SDK 2.33)")
    assert list(rows) == ["python", "torch", "torch-neuronx", "nki", "torchtitan", "transformers"]
