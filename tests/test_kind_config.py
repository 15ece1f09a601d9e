"""What `make kind` generates, checked without running anything: the cluster config, the CNI config,
and the merged image archive kind reads its tags from."""

from __future__ import annotations

import io
import ipaddress
import json
import tarfile
from pathlib import Path

import yaml

from conftest import ROOT
from tasklease_dev import kind, kind_images


def test_the_generated_config_is_kind_config_yaml_with_the_local_image_and_no_kindnetd() -> None:
    original = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    before = json.dumps(original)
    generated = kind.local_config(original)
    assert json.dumps(original) == before, "the users' config must stay as it is"
    assert generated["name"] == original["name"]
    assert [n["role"] for n in generated["nodes"]] == [n["role"] for n in original["nodes"]] == [
        "control-plane", "worker"]
    assert {n["image"] for n in generated["nodes"]} == {kind_images.NODE_IMAGE}
    assert generated["networking"]["disableDefaultCNI"] is True


def test_the_cni_config_gives_pods_addresses_from_the_nodes_pod_cidr_only() -> None:
    config = json.loads(kind.cni_config("10.244.1.0/24"))
    ptp = config["plugins"][0]
    assert ptp["type"] == "ptp" and ptp["ipMasq"] is False
    (subnet,) = ptp["ipam"]["ranges"][0]
    assert ipaddress.ip_network(subnet["subnet"]) == ipaddress.ip_network("10.244.1.0/24")


def _archive(path: Path, repo: str, tag: str, layer: bytes) -> Path:
    with tarfile.open(path, "w") as out:
        for name, data in (("manifest.json", json.dumps([{"Config": f"{repo}.json", "RepoTags": [f"{repo}:{tag}"],
                                                          "Layers": [f"{repo}/layer.tar"]}]).encode()),
                           (f"{repo}.json", b"{}"), (f"{repo}/layer.tar", layer),
                           ("repositories", json.dumps({repo: {tag: "id"}}).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return path


def test_merged_archives_list_every_tag_in_repositories_before_the_manifest(tmp_path: Path) -> None:
    parts = [_archive(tmp_path / "a.tar", "registry.k8s.io/kube-apiserver", "v1.35.4", b"a"),
             _archive(tmp_path / "b.tar", "docker.io/kindest/kindnetd", "v1", b"b")]
    merged = tmp_path / "merged.tar"
    kind_images.merge_archives(parts, merged)
    with tarfile.open(merged) as archive:
        names = archive.getnames()
        # kind reads whichever metadata file comes first, and from manifest.json only one image.
        assert names[:2] == ["repositories", "manifest.json"]
        repositories = json.loads(archive.extractfile("repositories").read())  # type: ignore[union-attr]
        manifest = json.loads(archive.extractfile("manifest.json").read())  # type: ignore[union-attr]
    assert repositories == {"registry.k8s.io/kube-apiserver": {"v1.35.4": "id"},
                            "docker.io/kindest/kindnetd": {"v1": "id"}}
    assert [m["RepoTags"] for m in manifest] == [["registry.k8s.io/kube-apiserver:v1.35.4"],
                                                 ["docker.io/kindest/kindnetd:v1"]]
    assert sorted(names[2:]) == sorted([
        "registry.k8s.io/kube-apiserver.json", "registry.k8s.io/kube-apiserver/layer.tar",
        "docker.io/kindest/kindnetd.json", "docker.io/kindest/kindnetd/layer.tar"])
