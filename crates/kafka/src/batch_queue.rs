//! Partition queues taken many messages at a time.
//!
//! rdkafka takes one message from a queue per call, and every call reads the
//! clock three times and takes the queue's lock: at 1,024 partitions that was a
//! sixth of the process's CPU (`perf`), more than the copying of the records.
//! librdkafka's `rd_kafka_consume_batch_queue` takes up to N messages under one
//! lock. rdkafka does not offer it for a partition queue, so this module calls
//! librdkafka directly, and nothing of that leaves it: a message is lent to a
//! closure and destroyed when the closure returns.

use std::ffi::{CStr, CString, c_char, c_void};
use std::ptr::{self, NonNull};

use rdkafka::ClientContext;
use rdkafka::bindings as rd;
use rdkafka::client::Client;
use rdkafka::message::{Header, Headers, Message, Timestamp};
use rdkafka::types::RDKafkaErrorCode;

/// A handle of its own on a partition's queue, which rdkafka's
/// `split_partition_queue` detached from the consumer's queue. Both handles
/// name the same librdkafka queue; this one only takes messages from it.
pub(crate) struct BatchQueue {
    queue: NonNull<rd::rd_kafka_queue_t>,
    taken: Vec<*mut rd::rd_kafka_message_t>,
}

// SAFETY: librdkafka's queues are locked internally and may be used from any
// thread; the message pointers in `taken` are only held within `take`.
unsafe impl Send for BatchQueue {}

impl BatchQueue {
    /// A handle on the queue of `topic`'s `partition` in `client`, or `None`
    /// if librdkafka has no such partition (or `topic` holds a NUL byte).
    pub(crate) fn of<C: ClientContext>(
        client: &Client<C>,
        topic: &str,
        partition: i32,
    ) -> Option<BatchQueue> {
        let topic = CString::new(topic).ok()?;
        // SAFETY: `native_ptr` is a live client while `client` is borrowed; the
        // queue returned holds its own reference, released in `drop`.
        let queue = unsafe {
            rd::rd_kafka_queue_get_partition(client.native_ptr(), topic.as_ptr(), partition)
        };
        NonNull::new(queue).map(|queue| BatchQueue {
            queue,
            taken: Vec::new(),
        })
    }

    /// How many messages are queued now.
    pub(crate) fn len(&self) -> usize {
        // Safe: the queue lives as long as `self`.
        unsafe { rd::rd_kafka_queue_length(self.queue.as_ptr()) }
    }

    /// Takes at most `max` messages that are queued now, without waiting, and
    /// lends each in turn to `each`. Returns how many it took. A message taken
    /// counts as consumed for librdkafka, so `each` must keep what it needs.
    pub(crate) fn take(
        &mut self,
        max: usize,
        mut each: impl FnMut(Result<&Polled<'_>, RDKafkaErrorCode>),
    ) -> usize {
        let max = max.max(1);
        self.taken.clear();
        self.taken.reserve(max);
        // SAFETY: `taken` has room for `max` pointers; librdkafka writes the
        // first `n` of them and gives each message's ownership to the caller.
        let n = unsafe {
            let n = rd::rd_kafka_consume_batch_queue(
                self.queue.as_ptr(),
                0,
                self.taken.as_mut_ptr(),
                max,
            );
            let n = usize::try_from(n).unwrap_or(0).min(max);
            self.taken.set_len(n);
            n
        };
        // Destroyed even if `each` panics, so that no message outlives its lending.
        let guard = Destroy(&mut self.taken);
        for &message in guard.0.iter() {
            // SAFETY: librdkafka returned a valid message, destroyed only by the guard.
            let raw = unsafe { &*message };
            if raw.err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                each(Ok(&Polled { raw }));
            } else {
                each(Err(raw.err.into()));
            }
        }
        n
    }
}

/// Destroys the messages taken when dropped.
struct Destroy<'a>(&'a mut Vec<*mut rd::rd_kafka_message_t>);

impl Drop for Destroy<'_> {
    fn drop(&mut self) {
        for message in self.0.drain(..) {
            // SAFETY: each was returned by librdkafka and is destroyed once.
            unsafe { rd::rd_kafka_message_destroy(message) };
        }
    }
}

impl Drop for BatchQueue {
    fn drop(&mut self) {
        // SAFETY: the reference taken in `of`, released once.
        unsafe { rd::rd_kafka_queue_destroy(self.queue.as_ptr()) };
    }
}

/// A message lent by [`BatchQueue::take`].
pub(crate) struct Polled<'a> {
    raw: &'a rd::rd_kafka_message_t,
}

/// Lends `len` bytes at `data`, or `None` for a null pointer.
///
/// # Safety
/// `data` must be null or point at `len` bytes that live as long as `'a`.
unsafe fn bytes<'a>(data: *const c_void, len: usize) -> Option<&'a [u8]> {
    if data.is_null() {
        None
    } else {
        // SAFETY: as the caller promises.
        Some(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) })
    }
}

impl Message for Polled<'_> {
    type Headers = PolledHeaders;

    fn key(&self) -> Option<&[u8]> {
        // SAFETY: the key lives as long as the message.
        unsafe { bytes(self.raw.key, self.raw.key_len) }
    }

    fn payload(&self) -> Option<&[u8]> {
        // SAFETY: the payload lives as long as the message.
        unsafe { bytes(self.raw.payload, self.raw.len) }
    }

    unsafe fn payload_mut(&mut self) -> Option<&mut [u8]> {
        // Lent shared; nothing here changes a message.
        None
    }

    fn topic(&self) -> &str {
        // SAFETY: the topic handle lives as long as the message.
        unsafe {
            let name = rd::rd_kafka_topic_name(self.raw.rkt);
            if name.is_null() {
                ""
            } else {
                CStr::from_ptr(name).to_str().unwrap_or("")
            }
        }
    }

    fn partition(&self) -> i32 {
        self.raw.partition
    }

    fn offset(&self) -> i64 {
        self.raw.offset
    }

    fn timestamp(&self) -> Timestamp {
        let mut kind = rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        // SAFETY: a valid message; librdkafka only reads it.
        let ms = unsafe { rd::rd_kafka_message_timestamp(self.raw, &mut kind) };
        match kind {
            _ if ms == -1 => Timestamp::NotAvailable,
            rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_CREATE_TIME => {
                Timestamp::CreateTime(ms)
            }
            rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_LOG_APPEND_TIME => {
                Timestamp::LogAppendTime(ms)
            }
            rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE => {
                Timestamp::NotAvailable
            }
        }
    }

    fn headers(&self) -> Option<&PolledHeaders> {
        let mut headers = ptr::null_mut();
        // SAFETY: a valid message; the headers it parses belong to it and live
        // as long as it does.
        let err = unsafe {
            rd::rd_kafka_message_headers(ptr::from_ref(self.raw).cast_mut(), &mut headers)
        };
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || headers.is_null() {
            return None;
        }
        // SAFETY: `PolledHeaders` is an opaque stand-in for librdkafka's headers,
        // only ever used behind a reference made from their pointer, as rdkafka's
        // own `BorrowedHeaders` is.
        Some(unsafe { &*headers.cast::<PolledHeaders>() })
    }
}

/// The headers of a [`Polled`] message, read in place.
pub(crate) struct PolledHeaders {
    _opaque: [u8; 0],
}

impl PolledHeaders {
    fn native(&self) -> *const rd::rd_kafka_headers_t {
        ptr::from_ref(self).cast()
    }
}

impl Headers for PolledHeaders {
    fn count(&self) -> usize {
        // SAFETY: made from librdkafka's headers in `Polled::headers`.
        unsafe { rd::rd_kafka_header_cnt(self.native()) }
    }

    fn try_get(&self, idx: usize) -> Option<Header<'_, &[u8]>> {
        let mut name: *const c_char = ptr::null();
        let mut value: *const c_void = ptr::null();
        let mut size = 0;
        // SAFETY: made from librdkafka's headers; what it points at lives as
        // long as the message.
        unsafe {
            let err =
                rd::rd_kafka_header_get_all(self.native(), idx, &mut name, &mut value, &mut size);
            if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
                return None;
            }
            Some(Header {
                // A name that is not UTF-8 is kept as an empty name rather than
                // dropping the record.
                key: CStr::from_ptr(name).to_str().unwrap_or(""),
                value: bytes(value, size),
            })
        }
    }
}
