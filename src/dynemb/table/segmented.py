"""The name of a key index of several segments, kept for the code that imports it.

A segmented index is :class:`dynemb.table.index.KeyIndex` built with ``capacities=`` (one
capacity per segment, the tables of a collection group); there is one implementation.
"""

from __future__ import annotations

from dynemb.table.index import KeyIndex

SegmentedKeyIndex = KeyIndex

__all__ = ["SegmentedKeyIndex"]
