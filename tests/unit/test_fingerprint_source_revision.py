"""Inside an image (a source tree without .git) the fingerprint reports the source revision the image
recorded at build time (/etc/muse-stack/image.json, written by `lock-env image-json` or the flake), not an
absent revision; git and MUSE_STACK_SOURCE_REVISION come first where they exist."""

from __future__ import annotations

import json

import pytest

from muse_stack.fingerprint import identity
from muse_stack.fingerprint.absent import is_absent


@pytest.fixture
def no_checkout(monkeypatch):
    monkeypatch.setattr(identity, "git_checkout", lambda root: None)
    monkeypatch.delenv("MUSE_STACK_SOURCE_REVISION", raising=False)


def _image(tmp_path, monkeypatch, **fields):
    info = {"lock_name": "cpu", "lock_sha256": "ab" * 32, "base_image": "b", "base_digest": None,
            "source_revision": None, "muse_stack_version": "0.1.0", "platform": "linux/amd64", "built_by": "docker"}
    info.update(fields)
    path = tmp_path / "image.json"
    path.write_text(json.dumps(info))
    monkeypatch.setenv("MUSE_STACK_IMAGE_INFO", str(path))
    return path


def test_an_image_without_git_reports_the_revision_it_recorded(tmp_path, monkeypatch, no_checkout):
    path = _image(tmp_path, monkeypatch, source_revision="0123456789abcdef0123456789abcdef01234567")
    rev = identity.source_revision()
    assert rev == {"revision": "0123456789abcdef0123456789abcdef01234567", "from": str(path)}
    # the whole identity section agrees with itself
    ident = identity.collect()
    assert ident["source_revision"]["revision"] == ident["image"]["source_revision"]


def test_an_image_built_without_a_revision_says_so(tmp_path, monkeypatch, no_checkout):
    path = _image(tmp_path, monkeypatch, source_revision=None)
    rev = identity.source_revision()
    assert is_absent(rev) and f"the image ({path}) records no source revision" in rev["absent"]


def test_outside_an_image_and_a_checkout_the_revision_is_absent(tmp_path, monkeypatch, no_checkout):
    monkeypatch.setenv("MUSE_STACK_IMAGE_INFO", str(tmp_path / "none.json"))
    rev = identity.source_revision()
    assert is_absent(rev) and "not in a muse-stack image" in rev["absent"]


def test_git_and_the_environment_come_before_the_images_record(tmp_path, monkeypatch, no_checkout):
    _image(tmp_path, monkeypatch, source_revision="aaaa")
    monkeypatch.setenv("MUSE_STACK_SOURCE_REVISION", "bbbb")
    assert identity.source_revision() == {"revision": "bbbb", "from": "MUSE_STACK_SOURCE_REVISION"}
    monkeypatch.setattr(identity, "git_checkout", lambda root: {"commit": "cccc", "dirty": False})
    assert identity.source_revision() == {"revision": "cccc", "dirty": False, "from": "git"}
