"""Row stores (``base.RowStore``) and the external storage a caching table writes back to."""

from dynemb.storage.external import DiskStorage, ExternalStorage, InMemoryStorage

__all__ = ["DiskStorage", "ExternalStorage", "InMemoryStorage"]
