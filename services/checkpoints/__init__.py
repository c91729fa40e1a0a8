"""The checkpoint service: commits staged checkpoints to an object store and applies retention.

core.py (pure decisions) · uploader.py (the commit/delete effects) · manifest.py (layout, restore) ·
objectstore.py (protocol, keys) · localstore.py / s3store.py (stores) · stores.py (open one by URL) ·
sweeper.py (dangling uploads).
"""
