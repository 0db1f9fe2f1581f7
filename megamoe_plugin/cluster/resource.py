"""What the emulated cluster creates on the machine (namespaces and links, CPU cgroups) as context managers that
remove it on every exit path, a failed creation included."""
from __future__ import annotations


class CreatedResource:
    """A context manager over ``create()`` and ``destroy()``: ``destroy`` runs on leaving the block and when
    ``create`` fails halfway (it must remove whatever part exists)."""

    def create(self) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
