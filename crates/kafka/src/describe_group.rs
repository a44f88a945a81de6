//! The members of a consumer group, whatever its protocol.
//!
//! librdkafka's old group listing (`rd_kafka_list_groups`, rdkafka's
//! `fetch_group_list`) sends the classic DescribeGroups request, to which a
//! Kafka 4 broker answers for a KIP-848 (`group.protocol = "consumer"`) group
//! with the state `Dead` and no members, even while members run. The admin API's
//! DescribeConsumerGroups asks such a group with ConsumerGroupDescribe. rdkafka
//! does not wrap it, so this module calls librdkafka directly, and nothing of
//! that leaves it.

use std::ffi::{CStr, CString, c_char};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::bindings as rd;
use rdkafka::client::Client;
use rdkafka::types::RDKafkaErrorCode;

/// Why a group could not be described: librdkafka's code and its message.
pub(crate) type Failure = (RDKafkaErrorCode, String);

/// The members `group_id` has now, as `(member id, client id)`, asked through
/// `client` within `timeout`. A group nobody ever joined has none. A blocking
/// call.
pub(crate) fn members<C: ClientContext>(
    client: &Client<C>,
    group_id: &str,
    timeout: Duration,
) -> Result<Vec<(String, String)>, Failure> {
    let group = CString::new(group_id).map_err(|_| {
        (
            RDKafkaErrorCode::InvalidArgument,
            "the group id holds a NUL byte".to_owned(),
        )
    })?;
    let rk = client.native_ptr();
    let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: `rk` is a live client handle for as long as `client` is borrowed.
    // Every object made here is destroyed by its guard before returning, and
    // every pointer read out of the result event is used only while the event
    // lives (librdkafka owns them through it); strings are copied out at once.
    unsafe {
        let queue = Owned(rd::rd_kafka_queue_new(rk), rd::rd_kafka_queue_destroy);
        let options = Owned(
            rd::rd_kafka_AdminOptions_new(
                rk,
                rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBECONSUMERGROUPS,
            ),
            rd::rd_kafka_AdminOptions_destroy,
        );
        let mut errstr = [0 as c_char; 256];
        let set = rd::rd_kafka_AdminOptions_set_request_timeout(
            options.0,
            millis,
            errstr.as_mut_ptr(),
            errstr.len(),
        );
        if set != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err((set.into(), text(errstr.as_ptr())));
        }
        let mut groups = [group.as_ptr()];
        rd::rd_kafka_DescribeConsumerGroups(rk, groups.as_mut_ptr(), 1, options.0, queue.0);
        // The request times out on its own at `timeout`; the queue is waited on a
        // little longer, so that its answer, even an error, arrives.
        let deadline = Instant::now() + timeout + Duration::from_secs(5);
        let event = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err((
                    RDKafkaErrorCode::RequestTimedOut,
                    format!("no answer within {millis} ms"),
                ));
            }
            let wait = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
            let event = rd::rd_kafka_queue_poll(queue.0, wait);
            if event.is_null() {
                continue;
            }
            let event = Owned(event, rd::rd_kafka_event_destroy);
            if rd::rd_kafka_event_type(event.0) == rd::RD_KAFKA_EVENT_DESCRIBECONSUMERGROUPS_RESULT
            {
                break event;
            }
        };
        let failed = rd::rd_kafka_event_error(event.0);
        if failed != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err((
                failed.into(),
                text(rd::rd_kafka_event_error_string(event.0)),
            ));
        }
        let result = rd::rd_kafka_event_DescribeConsumerGroups_result(event.0);
        let mut count = 0;
        let described = rd::rd_kafka_DescribeConsumerGroups_result_groups(result, &mut count);
        let mut members = Vec::new();
        for i in 0..count {
            let description = *described.add(i);
            let error = rd::rd_kafka_ConsumerGroupDescription_error(description);
            if !error.is_null() {
                let code = rd::rd_kafka_error_code(error);
                if code == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_GROUP_ID_NOT_FOUND {
                    continue;
                }
                return Err((code.into(), text(rd::rd_kafka_error_string(error))));
            }
            for m in 0..rd::rd_kafka_ConsumerGroupDescription_member_count(description) {
                let member = rd::rd_kafka_ConsumerGroupDescription_member(description, m);
                members.push((
                    text(rd::rd_kafka_MemberDescription_consumer_id(member)),
                    text(rd::rd_kafka_MemberDescription_client_id(member)),
                ));
            }
        }
        Ok(members)
    }
}

/// A librdkafka object destroyed when this goes.
struct Owned<T>(*mut T, unsafe extern "C" fn(*mut T));

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: made by the matching constructor and destroyed only here.
            unsafe { (self.1)(self.0) }
        }
    }
}

/// A C string librdkafka owns, copied; empty for a null pointer.
///
/// # Safety
/// `s` is null or points to a NUL-terminated string that lives during the call.
unsafe fn text(s: *const c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}
