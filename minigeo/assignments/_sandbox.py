"""The grader's sandbox: runs one submitted notebook and answers the grader's calls of its functions.

``assignments/grade.py`` starts ``python -m minigeo.assignments._sandbox CONFIG`` in a fresh
temporary folder (inside Linux namespaces where it can: no network, its own process list, the
course's folders hidden) with a copy of minigeo.  This process

1. replaces the library's answers to the assignment's tasks (``CONFIG["blocked"]``, public names
   such as ``horizontal_projection``) by functions that raise, everywhere in minigeo, and
   every ``minigeo.assignments.check_*`` by a stub: nothing the notebook prints counts;
2. runs the notebook's code cells in order in an IPython shell, telling the grader when each starts;
3. then answers the grader's calls: ``(function name, pickled arguments)`` in, the function's return
   value out, as plain arrays in an ``.npz`` with a JSON description (never a pickle: the grader
   must not unpickle what a submission sends).

The grader runs the checks in its own process on inputs it draws from a fresh secret seed, and
compares what comes back with references it computes itself.  Messages are frames on two pipes:
8 bytes header length, 8 bytes payload length, a JSON header, the payload.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import signal
import struct
import sys

import numpy as np

_HEAD = struct.Struct("<QQ")
_MAX_STR = 2000


# ------------------------------------------------------------------------------- frames


def write_frame(fd: int, header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    data = _HEAD.pack(len(head), len(payload)) + head + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class FrameReader:
    """Frames from a pipe, read with a time limit (``select``) by the grader, or blocking."""

    def __init__(self, fd: int, max_bytes: int = 2**31) -> None:
        self.fd, self.buf, self.max_bytes, self.eof = fd, bytearray(), max_bytes, False

    def _frame(self):
        if len(self.buf) < _HEAD.size:
            return None
        n_head, n_payload = _HEAD.unpack_from(self.buf)
        if n_head + n_payload > self.max_bytes:
            raise ValueError("a message larger than the grader accepts")
        end = _HEAD.size + n_head + n_payload
        if len(self.buf) < end:
            return None
        head = json.loads(bytes(self.buf[_HEAD.size : _HEAD.size + n_head]))
        payload = bytes(self.buf[_HEAD.size + n_head : end])
        del self.buf[:end]
        if not isinstance(head, dict):
            raise ValueError("a message header that is not an object")
        return head, payload

    def read(self, timeout: float | None = None):
        """The next frame; None at end of file or when ``timeout`` seconds pass first."""
        import select

        while True:
            frame = self._frame()
            if frame is not None:
                return frame
            if self.eof:
                return None
            if timeout is not None:
                ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
                if not ready:
                    return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                self.eof = True
            self.buf += chunk


# ------------------------------------------------------------ return values, without pickle


def encode(value, arrays: dict, depth: int = 0) -> dict:
    """A JSON description of ``value`` (nested tuples, lists, str-keyed dicts, arrays, numbers, str,
    None); its arrays go into ``arrays``.  Anything else is described by its type's name."""
    if depth > 20:
        return {"t": "other", "name": "deeply nested object"}
    if value is None:
        return {"t": "none"}
    if isinstance(value, str):
        return {"t": "str", "v": value[:_MAX_STR]}
    if isinstance(value, (tuple, list)):
        return {"t": type(value).__name__ if type(value) in (tuple, list) else "tuple",
                "v": [encode(v, arrays, depth + 1) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"t": "dict", "v": {k: encode(v, arrays, depth + 1) for k, v in value.items()}}
    if isinstance(value, (bool, int, float, complex, np.generic, np.ndarray)) or hasattr(value, "__array__"):
        try:
            arr = np.asarray(value)
        except Exception:
            return {"t": "other", "name": type(value).__name__}
        if arr.dtype.kind in "biufc":
            key = f"a{len(arrays)}"
            arrays[key] = arr
            return {"t": "array", "k": key}
    return {"t": "other", "name": type(value).__name__}


def decode(desc, arrays):
    """The value :func:`encode` described (arrays as NumPy arrays; other objects as an empty
    instance of a class with the original type's name)."""
    kind = desc.get("t") if isinstance(desc, dict) else None
    if kind == "none":
        return None
    if kind == "str":
        return str(desc.get("v", ""))
    if kind in ("tuple", "list"):
        items = [decode(v, arrays) for v in desc.get("v", [])]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {str(k): decode(v, arrays) for k, v in dict(desc.get("v", {})).items()}
    if kind == "array":
        return arrays[str(desc["k"])]
    name = str(desc.get("name", "object")) if isinstance(desc, dict) else "object"
    name = "".join(ch for ch in name if ch.isalnum() or ch == "_")[:60] or "object"
    return type(name, (), {"__repr__": lambda self: f"<{name}>"})()


def pack_value(value) -> tuple[dict, bytes]:
    arrays: dict = {}
    desc = encode(value, arrays)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return desc, buf.getvalue()


def unpack_value(desc, payload: bytes):
    with np.load(io.BytesIO(payload), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return decode(desc, arrays)


# ------------------------------------------------------------------------ the sandbox side


class _TimedOut(BaseException):
    pass


def _blocker(name: str):
    public = "mg." + name

    def blocked(*args, **kwargs):
        raise RuntimeError(
            f"{public} computes this task's answer, so the grader blocks it while your functions run: "
            "write the computation yourself"
        )

    blocked.__name__ = blocked.__qualname__ = name
    return blocked


def block(names: list[str]) -> None:
    """Replace each public ``minigeo.<name>`` (``<name>`` may be ``quotient.gl_metric``) by a function
    that raises, in every minigeo module."""
    import pkgutil

    import minigeo

    for info in pkgutil.walk_packages(minigeo.__path__, "minigeo."):
        if info.name != __name__:
            try:
                importlib.import_module(info.name)
            except Exception:  # an optional dependency missing: nothing of it can be used either
                pass
    for name in names:  # "ggn", or a namespaced name: "quotient.horizontal_projection"
        original = minigeo
        for part in name.split("."):
            original = getattr(original, part, None)
        if original is None:
            continue
        stand_in = _blocker(name)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").partition(".")[0] != "minigeo":
                continue
            for attr, value in list(vars(mod).items()):
                if value is original:
                    setattr(mod, attr, stand_in)


def _stub_checks() -> None:
    from minigeo import assignments

    from ._kit import CheckReport

    def stub(name):
        def check(fn, *args, **kwargs):
            message = f"({name} is not run here: the grader runs the checks in its own process)"
            return CheckReport(name, False, message)

        return check

    for name in assignments.__all__:
        if name.startswith("check_"):
            setattr(assignments, name, stub(name))


def _error_line(err: BaseException) -> dict:
    text = str(err).strip()
    return {"ename": type(err).__name__, "evalue": text.splitlines()[0][:_MAX_STR] if text else ""}


def main(config_path: str) -> int:
    with open(config_path) as f:
        config = json.load(f)
    os.unlink(config_path)
    fd_in, fd_out = int(config["fd_in"]), int(config["fd_out"])
    from ._kit import _float64

    block(list(config.get("blocked", [])))
    _stub_checks()
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    with open(config["notebook"]) as f:
        nb = json.load(f)
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        write_frame(fd_out, {"cell": i})
        result = shell.run_cell(source, store_history=False)
        err = result.error_before_exec or result.error_in_exec
        if err is not None:
            write_frame(fd_out, {"error": _error_line(err), "cell": i})
            return 0
    sys.stdout.flush()
    write_frame(fd_out, {"ready": True})

    def alarm(signum, frame):
        raise _TimedOut()

    signal.signal(signal.SIGALRM, alarm)
    reader = FrameReader(fd_in)
    while True:
        frame = reader.read()
        if frame is None:
            return 0
        head, payload = frame
        if head.get("exit"):
            return 0
        rid, name = head.get("id"), str(head.get("call"))
        fn = shell.user_ns.get(name)
        if not callable(fn):
            write_frame(fd_out, {"id": rid, "missing": True})
            continue
        reply: dict = {"id": rid}
        data = b""
        try:
            with _float64():
                args, kwargs = pickle.loads(payload)
                signal.setitimer(signal.ITIMER_REAL, max(0.01, float(head.get("limit", 120))))
                try:
                    value = fn(*args, **kwargs)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                desc, data = pack_value(value)
            reply["value"] = desc
        except _TimedOut:
            reply["timed_out"] = True
        except BaseException as err:  # noqa: BLE001 - everything a student's function raises is reported
            reply["raised"] = _error_line(err)
        sys.stdout.flush()
        write_frame(fd_out, reply, data)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
