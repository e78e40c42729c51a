"""A task's unacknowledged replies: the last reply to each consumer of a task is
kept (`UnackedReplies`) until the consumer's next request acknowledges it, so
that an element leaves the worker only when its consumer has it. A reply whose
transfer failed waits for the consumer's retry, or goes back to the front of the
task's buffer (the `requeue` callable the task's runner passes) if the consumer
is gone; a reply cut for a slow link keeps its tail for the consumer's next
requests (`ConsumerTurn.cut`). docs/transport-notes.md ("No element lost in
transit") describes the protocol end to end.

Owns `UnackedReplies`, `ConsumerTurn`, `Reply` and the timings `UNACKED_TTL_S`
and `REQUEUE_AFTER_S`. Imports only `dataservice.errors` of the project: the
task's buffer is reached through the `requeue` callable, never imported, so
`task_runner.py` (which owns a runner's `UnackedReplies`) and `serving.py` import
this module, not the other way round.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from dataservice import errors

log = logging.getLogger(__name__)

# A consumer that has not asked for this long is taken for gone: its entry (and the
# reply it did not acknowledge) is dropped and counted. A live consumer re-asks within
# seconds of a failed request, so only a consumer that stopped for good loses an entry.
UNACKED_TTL_S = 300.0
# A consumer whose reply's transfer failed and that has not asked again for this long
# is taken for gone: its first come, first served elements go to the other consumers.
REQUEUE_AFTER_S = 5.0


@dataclasses.dataclass
class Reply:
    """One reply to a consumer, as sent: encoded (and compressed) elements.

    Attributes:
        elements: Encoded elements (`codec.encode`, then `codec.compress`).
        end_of_sequence: The reply ends the task's stream.
        error: A pipeline failure (reported after the elements), or None.
        requeue_on_failure: First come, first served elements: if the transfer fails
            and the consumer does not come back for them within `REQUEUE_AFTER_S`,
            they go back to the front of the task's buffer (a coordinated round's or
            a trainer's elements are that consumer's alone: they wait for its retry).
    """

    elements: list[bytes]
    end_of_sequence: bool
    error: errors.RemoteErrorInfo | None
    requeue_on_failure: bool = False


@dataclasses.dataclass
class _Consumer:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    sequence: int = 0  # of the last request served
    reply: Reply | None = None  # its reply, until acknowledged (or requeued)
    sent: bool = False  # the reply's transfer completed (on the worker's side)
    failed_at: float | None = None  # time.monotonic() its transfer failed, if it did
    last_seen: float = 0.0  # time.monotonic() of its last request
    # Elements taken for this consumer and not sent yet: the end of a reply that a
    # retry asked to cut to a smaller max_bytes (a slow link), with that reply's end
    # of sequence and error; the next requests get them before anything else.
    rest: Reply | None = None


def _fitting(elements: list[bytes], max_bytes: int) -> int:
    """How many of `elements`, from the first, fit in `max_bytes` (at least one)."""
    total = 0
    for k, element in enumerate(elements):
        total += len(element)
        if k and total > max_bytes:
            return k
    return len(elements)


class ConsumerTurn:
    """One request's exclusive hold on its consumer's entry (`UnackedReplies.begin`).

    Attributes:
        replay: The reply to send again (the request repeats the sequence number of
            one the consumer did not get), or None: make a new reply and `store` it.
    """

    def __init__(self, owner: UnackedReplies, entry: _Consumer) -> None:
        self._owner = owner
        self._entry = entry
        self.replay: Reply | None = entry.reply
        self._done = False

    def store(self, reply: Reply) -> None:
        """Keeps `reply` as the consumer's un-acknowledged one."""
        self._entry.reply = reply
        self._entry.sent = False

    def take_rest(self, max_bytes: int) -> Reply | None:
        """The next reply from the elements a cut left with this consumer (`cut`):
        those that fit in `max_bytes` (at least one; 0: all), with the end of sequence
        and error of the reply they came from once the last of them goes. None if no
        element was left. `store` it."""
        rest = self._entry.rest
        if rest is None:
            return None
        k = _fitting(rest.elements, max_bytes) if max_bytes > 0 else len(rest.elements)
        if k == len(rest.elements):
            self._entry.rest = None
            return rest
        self._entry.rest = Reply(
            rest.elements[k:], rest.end_of_sequence, rest.error, rest.requeue_on_failure
        )
        return Reply(rest.elements[:k], False, None, rest.requeue_on_failure)

    def cut(self, max_bytes: int) -> Reply | None:
        """Cuts the stored reply to the elements that fit in `max_bytes` (at least
        one) and returns it: a client on a slow link retries with a smaller
        `max_bytes` than the reply was made for. The elements cut off are not sent
        now: first come, first served ones (of a reply without an error) go back to
        the front of the task's buffer, for the next read; others (a coordinated
        round's, a trainer's, a reply that ends with an error, or one made from such
        a rest) stay with this consumer for its next requests (`take_rest`). Nothing
        is lost or sent twice: the consumer has none of them (it asks again only for
        a reply it did not get completely, or for the next one)."""
        entry = self._entry
        reply = entry.reply
        if reply is None or max_bytes <= 0:
            return reply
        k = _fitting(reply.elements, max_bytes)
        if k == len(reply.elements):
            return reply
        head = Reply(reply.elements[:k], False, None, reply.requeue_on_failure)
        tail = Reply(
            reply.elements[k:], reply.end_of_sequence, reply.error, reply.requeue_on_failure
        )
        entry.reply = head
        owner = self._owner
        if (
            entry.rest is None
            and tail.requeue_on_failure
            and tail.error is None
            and owner._requeue is not None
        ):
            # The task still knows whether its stream ended: the end comes after them.
            owner.cut_back(tail.elements)
        elif entry.rest is None:
            entry.rest = tail
        else:  # a reply made from the rest, cut again: its tail goes before the rest
            entry.rest = Reply(
                tail.elements + entry.rest.elements,
                entry.rest.end_of_sequence,
                entry.rest.error,
                entry.rest.requeue_on_failure,
            )
        return head

    def finish(self, sent: bool) -> None:
        """Ends the turn. `sent`: the reply's transfer completed on the worker's side
        (the consumer has it unless it dies now). Either way the reply stays until the
        consumer acknowledges it; one whose transfer failed waits for the consumer's
        retry (`UnackedReplies` says how long)."""
        if self._done:
            return
        self._done = True
        entry = self._entry
        owner = self._owner
        with owner._mu:
            entry.sent = sent
            was_parked = entry.failed_at is not None
            entry.failed_at = None if sent or entry.reply is None else time.monotonic()
            owner._parked += (entry.failed_at is not None) - was_parked
            entry.last_seen = time.monotonic()
            owner._cv.notify_all()
        entry.lock.release()


class UnackedReplies:
    """The last reply to each consumer of one task, kept until the consumer
    acknowledges it, so that no element is lost between the worker's buffer and
    the consumer (a reply that misses the client's deadline, a dropped connection).
    Thread-safe.

    A consumer is a key its client chooses (one per reader and task) and numbers
    its requests 1, 2, 3, ...: request s acknowledges the reply to s - 1 (the
    consumer asks again only once it has a reply), and a retry repeats s and gets
    the same reply again. One request of a consumer is served at a time (`begin`
    waits for the previous one to end).

    What happens to un-acknowledged elements:
      - A transfer that failed on the worker's side (the stream was cancelled or
        broke: the consumer does not have the reply): the reply waits for that
        consumer's retry. First come, first served elements go back to the front of
        the task's buffer (`requeue`), for the task's other consumers, once the
        consumer has not come back for `requeue_after_s` (a live one retries within
        about a second or two); until then the task's other consumers do not get
        the end of sequence (`settle_failed`). A coordinated
        round's or a trainer's reply is that consumer's alone and keeps waiting.
      - A reply sent completely whose consumer never asks again (it finished at
        the end of sequence, was abandoned, or died just after receiving it): it
        reached the consumer's side, so it is not sent to anyone else.
      - Whatever is still held when the consumer's entry expires (no request for
        `ttl_s`) or when the task stops is counted (`dropped_elements`) and logged.
    """

    def __init__(
        self,
        task_id: int,
        requeue: Callable[[list[bytes]], None] | None = None,
        ttl_s: float | None = None,
        requeue_after_s: float | None = None,
    ) -> None:
        self.task_id = task_id
        self._requeue = requeue
        self._ttl_s = UNACKED_TTL_S if ttl_s is None else ttl_s
        self._requeue_after_s = REQUEUE_AFTER_S if requeue_after_s is None else requeue_after_s
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)  # notified when a failed reply settles
        # guarded by self._mu:
        self._consumers: dict[str, _Consumer] = {}
        self._parked = 0  # entries whose reply's transfer failed (failed_at set)
        self._next_sweep = time.monotonic() + self._ttl_s / 4
        self._closed = False
        self.acked_elements = 0
        self.resent_replies = 0
        self.requeued_elements = 0
        self.dropped_elements = 0
        self.cut_elements = 0  # cut off replies and given back to the task (slow links)

    def stats(self) -> dict[str, int]:
        """Counters: consumers with an entry, `unacked_elements` held now,
        (in replies and cut-off rests), `failed_replies` waiting for their consumer's
        retry, `acked_elements`, `resent_replies`, `requeued_elements`,
        `dropped_elements`, `cut_elements`."""
        with self._mu:
            return {
                "consumers": len(self._consumers),
                "unacked_elements": sum(
                    len(c.reply.elements) if c.reply else 0 for c in self._consumers.values()
                )
                + sum(len(c.rest.elements) if c.rest else 0 for c in self._consumers.values()),
                "failed_replies": self._parked,
                "acked_elements": self.acked_elements,
                "resent_replies": self.resent_replies,
                "requeued_elements": self.requeued_elements,
                "dropped_elements": self.dropped_elements,
                "cut_elements": self.cut_elements,
            }

    def begin(self, key: str, sequence: int, timeout_s: float) -> ConsumerTurn:
        """Starts serving request `sequence` of consumer `key`: waits up to `timeout_s`
        seconds for the consumer's previous request to end, then acknowledges the
        previous reply (`sequence` is one more) or hands it back to resend (`sequence`
        repeats it). A key not seen before (or expired, or from before a worker
        restart) starts at any sequence number. Call `ConsumerTurn.finish` always.

        Raises:
            DeadlineExceededError: The consumer's previous request is still being
                answered after `timeout_s` (the client retries).
            FailedPreconditionError: `sequence` is neither the last one nor the next
                (a client bug), or the task has stopped.
            InvalidArgumentError: `sequence` is not positive.
        """
        if sequence <= 0:
            raise errors.InvalidArgumentError(
                f"GetElements for task {self.task_id}: sequence must be >= 1 with a "
                f"consumer_key, got {sequence}"
            )
        now = time.monotonic()
        with self._mu:
            if self._closed:
                raise errors.FailedPreconditionError(f"task {self.task_id} has stopped")
            if now >= self._next_sweep:
                self._sweep_locked(now)
            back = self._take_failed_locked(now - self._requeue_after_s, key)
            entry = self._consumers.get(key)
            if entry is None:
                entry = self._consumers[key] = _Consumer(sequence=sequence - 1, last_seen=now)
            entry.last_seen = now
        self._give_back(back)
        if not entry.lock.acquire(timeout=max(0.0, timeout_s)):
            raise errors.DeadlineExceededError(
                f"consumer {key} of task {self.task_id}: its previous request (sequence "
                f"{entry.sequence}) was still being answered after {timeout_s:.1f} s; retry"
            )
        try:
            with self._mu:
                if sequence == entry.sequence + 1:
                    if entry.reply is not None:
                        self.acked_elements += len(entry.reply.elements)
                    entry.reply, entry.sent, entry.sequence = None, False, sequence
                elif sequence == entry.sequence:
                    if entry.reply is not None:
                        self.resent_replies += 1
                else:
                    raise errors.FailedPreconditionError(
                        f"consumer {key} of task {self.task_id} sent request {sequence} after "
                        f"request {entry.sequence}: requests must be numbered 1, 2, 3, ... "
                        "(a retry repeats its number)"
                    )
                if entry.failed_at is not None:  # its own retry (or ack) takes it
                    entry.failed_at = None
                    self._parked -= 1
                    self._cv.notify_all()
                self._consumers[key] = entry  # back, should it have expired meanwhile
        except BaseException:
            entry.lock.release()
            raise
        return ConsumerTurn(self, entry)

    def settle_failed(self, timeout_s: float) -> tuple[int, bool]:
        """Called when the task's stream is over for a consumer (its buffer is empty):
        first come, first served replies whose transfer failed are all that is left.
        Waits up to `timeout_s` seconds while such replies wait for their own
        consumers' retry, and gives back (`requeue`) those whose consumer has not come
        back within `requeue_after_s`, so the task's other consumers get them before
        the end of sequence, and the end only after them.

        Returns:
            (elements given back, whether failed replies still wait for a retry): the
            caller reports no end of sequence if either is non-zero.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                now = time.monotonic()
                back = self._take_failed_locked(now - self._requeue_after_s, "")
                waiting = [
                    e.failed_at
                    for e in self._consumers.values()
                    if e.failed_at is not None
                    and e.reply is not None
                    and e.reply.requeue_on_failure
                ]
                if back or not waiting or now >= deadline:
                    break
                self._cv.wait(min(deadline, min(waiting) + self._requeue_after_s) - now)
        self._give_back(back)
        return len(back), bool(waiting)

    def _take_failed_locked(self, failed_before: float, skip_key: str) -> list[bytes]:
        """Takes the failed first come, first served replies (not of `skip_key`,
        whose request is coming) that failed before `failed_before`."""
        if not self._parked:
            return []
        back: list[bytes] = []
        for key, entry in self._consumers.items():
            reply = entry.reply
            if (
                key == skip_key
                or entry.failed_at is None
                or entry.failed_at >= failed_before
                or reply is None
                or not reply.requeue_on_failure
                or entry.lock.locked()
            ):
                continue
            back.extend(reply.elements)
            self.requeued_elements += len(reply.elements)
            if entry.rest is not None and entry.rest.requeue_on_failure:
                back.extend(entry.rest.elements)
                self.requeued_elements += len(entry.rest.elements)
                entry.rest = None
            entry.reply, entry.failed_at = None, None
            self._parked -= 1
        return back

    def _give_back(self, elements: list[bytes]) -> None:
        if elements and self._requeue is not None:
            self._requeue(elements)

    def cut_back(self, elements: list[bytes]) -> None:
        """Elements cut off a first come, first served reply (`ConsumerTurn.cut`) go
        back to the front of the task's buffer."""
        with self._mu:
            self.cut_elements += len(elements)
        self._give_back(elements)

    def _sweep_locked(self, now: float) -> None:
        self._next_sweep = now + self._ttl_s / 4
        for key, entry in list(self._consumers.items()):
            if now - entry.last_seen < self._ttl_s or entry.lock.locked():
                continue
            del self._consumers[key]
            if entry.failed_at is not None:
                self._parked -= 1
            self._count_dropped_locked(key, entry, f"no request for {self._ttl_s:.0f} s")

    def _count_dropped_locked(self, key: str, entry: _Consumer, why: str) -> None:
        n = len(entry.reply.elements) if entry.reply is not None else 0
        n += len(entry.rest.elements) if entry.rest is not None else 0
        if not n:
            return
        self.dropped_elements += n
        log.info(
            "task %d: consumer %s did not acknowledge its last reply (%d elements, %s) "
            "before it went away (%s); they are not sent again",
            self.task_id,
            key,
            n,
            "sent" if entry.sent else "not sent completely",
            why,
        )

    def close(self) -> None:
        """The task stopped: counts the replies still un-acknowledged and drops them."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            for key, entry in self._consumers.items():
                self._count_dropped_locked(key, entry, "the task stopped")
            self._consumers.clear()
            self._parked = 0
