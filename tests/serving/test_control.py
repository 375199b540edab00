"""The control directory's protocol between ``freetoken serve`` and its model instances."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from freetoken.serving.control import InstanceControl, LauncherControl, process_alive


def test_a_registered_instance_that_vanished_is_fatal(tmp_path):
    launcher = LauncherControl(tmp_path)
    instance = InstanceControl("m", str(tmp_path))
    assert launcher.instance_pids() == [os.getpid()] and launcher.fatal() is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / f"stub-{gone.pid}").write_text("m")  # registered, never finalized
    assert not process_alive(gone.pid)
    assert f"stub (pid {gone.pid}) died without finalizing" in launcher.fatal()
    instance.close()
    assert os.getpid() not in launcher.instance_pids()


def test_engine_death_and_stop_deadline(tmp_path):
    launcher = LauncherControl(tmp_path)
    instance = InstanceControl("m", str(tmp_path))
    assert instance.stop_deadline() is None
    launcher.request_stop(2.0)
    assert 1.0 < instance.stop_deadline() - time.time() <= 2.0
    instance.report_death("RuntimeError('boom')")
    instance.close()  # the unload that follows a death keeps the reason
    assert "engine thread died" in launcher.fatal() and "boom" in launcher.fatal()


def test_without_a_directory_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("FREETOKEN_CONTROL_DIR", raising=False)
    instance = InstanceControl("m")
    assert instance.directory is None and instance.stop_deadline() is None
    instance.report_death("x")
    instance.close()
