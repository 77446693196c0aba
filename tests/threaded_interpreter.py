"""For scripts that run simulated ranks (threads), each interpreting its own Triton kernel
(TRITON_INTERPRET=1) while the others run. Triton's interpreter patches triton.language around every
launch and restores it afterwards, which would pull the rug from under the other threads: keep_patched()
keeps the patches for the life of the process instead (call it before any launch)."""
import threading

import triton.language as tl
import triton.runtime.interpreter as interpreter

SUPPORTED = hasattr(interpreter, "_patch_lang")


class _KeepPatched:
    def restore(self):
        pass


def keep_patched() -> None:
    patch_lang, patched, lock = interpreter._patch_lang, set(), threading.Lock()

    def patch_once(fn):
        with lock:
            langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
            if not langs <= patched:
                patch_lang(fn)
                patched.update(langs)
        return _KeepPatched()

    interpreter._patch_lang = patch_once
