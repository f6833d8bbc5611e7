"""A run that touches the disk: every path checked before compiling, an OS error later (a full
disk, a read-only or vanished path, a file where a directory goes) is one `error:` line naming the
path, no process hangs, and nothing a user made is replaced without `--overwrite`.

CI runs as root, where permission bits do not stop a write: full disks are /dev/full, a tmpfs
mount (skipped where mounting is not allowed) or an ENOSPC raised at jaxmeg's one write helper;
read-only is EROFS raised there. Only a real read-only mount shows os.access refusing --out up
front (test_cli_errors.test_read_only_out_is_an_error, on /proc/sys where it is read-only)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from jaxmeg import cli, paths
from jaxmeg.training.run_log import RunLog
from tests.test_cli_errors import assert_clean_error, script_cli, train_cli
from tests.test_train_cli import CLEAN_ENV, ROOT

pytestmark = pytest.mark.timeout(180)


def test_checkpoints_file_in_out_is_refused_before_compiling(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a user's notes")
    result = train_cli("--out", str(run))
    assert_clean_error(result, f"error: --out {run}: {run / 'checkpoints'} is not a directory")
    assert "compiled" not in result.stderr and len(result.stderr.splitlines()) == 1
    assert (run / "checkpoints").read_text() == "a user's notes"


# Saves into a directory that turned into a file after the up-front check: orbax's commit
# threads used to wait for a signal that never came, and the process never exited.
SAVE_INTO_A_FILE = """
import jax
from jaxmeg import cli
from jaxmeg.training.checkpoint import Checkpointer
from jaxmeg.training.state import init_state
from tests.helpers import tiny_config, trainable_for

trainable = trainable_for(tiny_config())
with jax.set_mesh(trainable.mesh):
    state = init_state(trainable, 0)
def save():
    checkpointer = Checkpointer("{target}", trainable)
    try:
        checkpointer.save(1, state, {{"step": 1}}, wait=True)
    finally:
        checkpointer.close()
raise SystemExit(cli.run_reporting_errors(save))
"""


def test_a_failed_save_ends_the_process_with_one_line(tmp_path):
    target = tmp_path / "checkpoints"
    target.write_text("not a directory")
    code = textwrap.dedent(SAVE_INTO_A_FILE.format(target=target))
    env = {**CLEAN_ENV, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )  # fmt: skip  (a hang is a TimeoutExpired here)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith("error:")
    ], result.stderr[-3000:]
    assert f"could not save the checkpoint of step 1 in {target}: Not a directory" in result.stderr
    assert "needs about" in result.stderr


@pytest.fixture(scope="module")
def tiny_state():
    from jaxmeg.training.state import init_state
    from tests.helpers import tiny_config, trainable_for

    trainable = trainable_for(tiny_config())
    with jax.set_mesh(trainable.mesh):
        return trainable, init_state(trainable, 0)


def failing_save(code: int):
    def save(self, step, *args, **kwargs):
        (self.directory / f"{step}.orbax-checkpoint-tmp-17").mkdir(parents=True)
        raise ValueError(
            f"RESOURCE_EXHAUSTED: Error writing in OCDBT database: Failed writing: "
            f"{self.directory}/x: {errno.errorcode[code]}: {os.strerror(code)} "
            f"[os_error_code='{code}']"
        )

    return save


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_failed_save_removes_its_temporary_directory_and_names_the_space(
    code, tiny_state, tmp_path, monkeypatch
):
    from jaxmeg.training.checkpoint import Checkpointer

    trainable, state = tiny_state
    checkpointer = Checkpointer(tmp_path / "checkpoints", trainable)
    checkpointer.save(1, state, {"step": 1}, wait=True)
    monkeypatch.setattr(
        type(checkpointer.manager), "save", lambda m, step, **k: failing_save(code)(
            checkpointer, step)
    )  # fmt: skip
    with pytest.raises(paths.PathError) as caught:
        checkpointer.save(2, state, {"step": 2}, wait=True)
    message = str(caught.value)
    assert message.startswith(f"could not save the checkpoint of step 2 in {tmp_path}")
    assert os.strerror(code) in message and "needs about" in message
    assert "checkpoints of steps [1] are intact" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
    checkpointer.close()  # does not raise the error again


def test_a_full_tmpfs_save_is_one_line_and_leaves_no_temporary(tiny_state, tmp_path, capfd):
    from jaxmeg.training.checkpoint import Checkpointer

    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip("this machine does not let the tests mount a small tmpfs")
    try:
        trainable, state = tiny_state
        checkpointer = Checkpointer(mount / "checkpoints", trainable)
        with pytest.raises(paths.PathError, match="No space left on device; the disk is full"):
            checkpointer.save(1, state, {"step": 1}, wait=True)
        checkpointer.close()
        assert list((mount / "checkpoints").iterdir()) == []
        err = capfd.readouterr().err
        assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_no_room_for_one_checkpoint_is_refused_before_compiling(tiny_state, tmp_path, monkeypatch):
    from jaxmeg.training.checkpoint import check_room

    monkeypatch.setattr(paths, "free_bytes", lambda path: 1000)
    with pytest.raises(paths.PathError, match="needs about 1.6 MB and only 1.0 KB are free"):
        check_room(tmp_path / "checkpoints", tiny_state[0])


def test_a_full_metrics_file_is_one_line():
    log = RunLog(3, 0, "/dev/full", None, progress=False)
    with pytest.raises(paths.PathError, match="metrics file /dev/full: No space left on device"):
        log.record({"step": 1, "loss": 1.0, "mfu": None, "tokens_per_sec": 1.0})
    log.close()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--metrics-file", "/dev/full"], "--metrics-file /dev/full is not a regular file"),
        (["--out", ""], "--out is empty; give a directory"),
        (["--metrics-file", ""], "--metrics-file is empty; give a file path"),
    ],
)  # fmt: skip
def test_unusable_paths_are_refused_before_jax_starts(args, message):
    assert_clean_error(train_cli(*args), f"error: {message}")


def test_a_users_file_is_not_replaced_by_metrics(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    result = train_cli("--metrics-file", str(notes))
    assert_clean_error(result, f"error: --metrics-file {notes} already exists and jaxmeg did not")
    assert "--overwrite" in result.stderr and notes.read_text() == "my notes\n"
    assert cli.run_paths_problem(None, str(notes), overwrite=True) is None
    ours = tmp_path / "m.jsonl"
    ours.write_text('{"step": 1, "loss": 2.5}\n')
    assert cli.run_paths_problem(None, str(ours), overwrite=False) is None


def test_out_on_a_directory_with_a_foreign_metrics_jsonl_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("time,value\n1,2\n")
    result = train_cli("--out", str(tmp_path))
    assert_clean_error(result, f"{tmp_path / 'metrics.jsonl'} is not a jaxmeg metrics file")
    assert "--overwrite" in result.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == "time,value\n1,2\n"
    assert cli.run_paths_problem(str(tmp_path), None, overwrite=True) is None


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_the_write_helper_names_the_path_and_keeps_the_old_file(code, tmp_path):
    target = tmp_path / "tokens.bin"
    target.write_bytes(b"old")

    def write(f):
        f.write(b"partial")
        raise OSError(code, os.strerror(code))

    with pytest.raises(paths.PathError, match=f"{target}: {os.strerror(code)}"):
        paths.write_file(target, write, "--output-prefix")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.bin"]


def test_preprocess_onto_an_existing_prefix_is_refused(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world, hello tokens " * 50)
    prefix = tmp_path / "corpus"
    (tmp_path / "corpus.bin").write_bytes(b"a run trained on this")
    args = ["--input", str(text), "--output-prefix", str(prefix), "--vocab-size", "300",
            "--no-progress"]  # fmt: skip
    result = script_cli("preprocess_data", *args)
    assert_clean_error(result, f"error: --output-prefix {prefix}: {prefix}.bin already exists")
    assert "--overwrite" in result.stderr
    assert (tmp_path / "corpus.bin").read_bytes() == b"a run trained on this"
    assert script_cli("preprocess_data", *args, "--overwrite").returncode == 0
    assert (tmp_path / "corpus.bin").read_bytes() != b"a run trained on this"


def test_token_file_write_failure_leaves_no_temporary(tmp_path, monkeypatch):
    from jaxmeg.data import token_file

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(token_file.np, "save", full)
    with pytest.raises(paths.PathError, match="No space left on device; the disk is full"):
        token_file.write_token_file(tmp_path / "t", [[1, 2, 3]], vocab_size=10, eot=0)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("imported") / "run"
    fixtures = ROOT / "tests" / "fixtures" / "hf" / "gpt2"
    result = script_cli("convert_hf", "import", "--from", str(fixtures), "--run", str(run))
    assert result.returncode == 0, result.stderr[-2000:]
    return run


def test_export_never_replaces_a_models_files_or_writes_into_the_run(imported_run, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text('{"mine": true}')
    result = script_cli("convert_hf", "export", "--run", str(imported_run), "--to", str(target))
    assert_clean_error(result, f"error: --to {target} already holds {target / 'config.json'}")
    assert (
        "--overwrite" in result.stderr and (target / "config.json").read_text() == '{"mine": true}'
    )
    inside = script_cli(
        "convert_hf", "export", "--run", str(imported_run), "--to", str(imported_run)
    )
    assert_clean_error(inside, f"--to {imported_run} is inside the run directory")
    assert not (imported_run / "config.json").exists()


def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(imported_run, tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (the errno in its text), not
    an OSError: that was a traceback; now the one line every other full disk gives."""
    from safetensors import SafetensorError

    from jaxmeg.models import hf
    from tests.test_cli_errors import in_process

    def full(*args, **kwargs):
        raise SafetensorError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
            '"No space left on device" })'
        )

    monkeypatch.setattr(hf, "save_file", full)
    target = tmp_path / "model"
    result = in_process("convert_hf", "export", "--run", str(imported_run), "--to", str(target))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"error: --to {target}: No space left on device"), lines
    assert not target.exists()


def test_exporting_the_same_run_again_replaces_its_own_export(imported_run, tmp_path):
    """What jaxmeg wrote for this run is no user's file: a second export of the run goes where
    the first did without --overwrite; another run's export there is kept."""
    target = tmp_path / "model"
    for _ in range(2):
        result = script_cli("convert_hf", "export", "--run", str(imported_run), "--to", str(target))
        assert result.returncode == 0, result.stderr[-2000:]
    marker = target / ".jaxmeg-export.json"
    marker.write_text(marker.read_text().replace(str(imported_run.resolve()), "/another/run"))
    again = script_cli("convert_hf", "export", "--run", str(imported_run), "--to", str(target))
    assert_clean_error(again, f"error: --to {target} already holds {target / 'config.json'}")


def test_convert_refuses_a_directory_given_twice(tmp_path):
    result = script_cli("convert_hf", "import", "--from", "a", "--hf", "b", "--run", str(tmp_path))
    assert_clean_error(result, "error: --from and --hf name the same directory; give it once")


def test_a_checkpoint_directory_that_cannot_be_made_is_one_line(tiny_state, tmp_path):
    from jaxmeg.training.checkpoint import Checkpointer

    (tmp_path / "run").write_text("a file where the run directory goes")
    with pytest.raises(paths.PathError, match="Not a directory; a file stands where"):
        Checkpointer(tmp_path / "run" / "checkpoints", tiny_state[0])
