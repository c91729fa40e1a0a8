"""The envelope every message carries, and the family bases events inherit from."""

from typing import ClassVar

import msgspec


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    """Base of every event and command on the wire.

    The envelope fields have defaults so a pure core can build a decision without ids or
    clocks; the service shell stamps `event_id`, `occurred_at` and `producer` before appending.
    The tag is the class name: renaming a class is a breaking change, and a tag is never reused.
    """

    SCHEMA: ClassVar[int] = 1  # newest schema version of this type that this code understands

    event_id: str = ""
    occurred_at: float = 0.0  # unix seconds
    causation_id: str = ""  # id of the event this one answers, "" for an origin
    producer: str = ""  # service, "cli", or "trainer"
    schema_version: int = 1


class JobEvent(Event, frozen=True, kw_only=True):
    """An event in one job's history; `job_version` is its contiguous position there (1, 2, ...)."""

    job_id: str
    job_version: int = 0  # assigned by the history on append; 0 means not appended yet


class RankEvent(JobEvent, frozen=True, kw_only=True):
    """Published by one trainer rank; `attempt` counts the job's (re)starts so stale ranks are told apart."""

    rank: int
    attempt: int = 0
    node: str = ""


class NodeEvent(Event, frozen=True, kw_only=True):
    """An event about one node of the fleet."""

    node: str
