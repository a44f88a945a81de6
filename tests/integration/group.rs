//! The parts of group mode against the real servers (`docs/scale-out.md`): the
//! directory of partitions in Cassandra, whose every change is conditional on
//! the entry as read, and membership in Kafka's consumer group, whose
//! revocations wait until the member lets them go.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use sluice_cassandra_store::{
    CassandraDirectory, CassandraLocation, CassandraOptions, CassandraStore,
};
use sluice_core::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, DirectoryEntry, Generation, Membership,
    MembershipChange, Offset, OffsetStore, Origin, PartitionDirectory, PartitionOffsets,
    PartitionStart, Revocation, TopicPartition, settled_ends,
};
use sluice_kafka::{GroupConfig, GroupProtocol, KafkaMembership};

fn options() -> CassandraOptions {
    CassandraOptions {
        replication: Some(sluice_tests::TEST_REPLICATION.to_owned()),
        ..CassandraOptions::default()
    }
}

fn off(v: i64) -> Offset {
    Offset::new(v).unwrap()
}

fn location(keyspace: &str, query: &str) -> CassandraLocation {
    CassandraLocation {
        nodes: sluice_tests::cassandra_nodes(),
        keyspace: keyspace.to_owned(),
        query: query.to_owned(),
    }
}

#[tokio::test]
async fn the_directory_changes_an_entry_only_as_it_was_read() {
    let keyspace = sluice_tests::unique_name("group_dir");
    let at = location(&keyspace, "orders");
    let mut first = CassandraDirectory::open(at.clone(), options())
        .await
        .unwrap();
    let mut second = CassandraDirectory::open(at.clone(), options())
        .await
        .unwrap();
    let (p0, p1) = (TopicPartition::new("t", 0), TopicPartition::new("t", 1));

    // Two members start together: the first origin recorded is everyone's.
    let mine = Origin {
        query_id: "id-1".to_owned(),
        initial: PartitionOffsets::from([(p0.clone(), off(5)), (p1.clone(), off(7))]),
    };
    let theirs = Origin {
        query_id: "id-2".to_owned(),
        initial: PartitionOffsets::from([(p0.clone(), off(6))]),
    };
    assert_eq!(first.originate(&mine).await.unwrap(), mine);
    assert_eq!(second.originate(&theirs).await.unwrap(), mine);
    let directory = second.read().await.unwrap();
    assert_eq!(directory.origin, Some(mine.clone()));
    assert_eq!(directory.start_of(&p0), PartitionStart::At(off(5)));

    // A new entry goes to one of two members that take it at once.
    let (a, b) = (Generation::new("a", 1), Generation::new("b", 1));
    assert!(first.take(&p0, None, &a, off(5)).await.unwrap());
    assert!(!second.take(&p0, None, &b, off(5)).await.unwrap());
    let directory = second.read().await.unwrap();
    assert_eq!(directory.start_of(&p0), PartitionStart::HeldBy(a.clone()));

    // Handed back, it starts where its holder ended; a stale expectation
    // takes nothing.
    first
        .hand_back(&a, &PartitionOffsets::from([(p0.clone(), off(42))]))
        .await
        .unwrap();
    let directory = second.read().await.unwrap();
    assert_eq!(directory.start_of(&p0), PartitionStart::At(off(42)));
    let stale = DirectoryEntry {
        owner: None,
        start: off(5),
    };
    assert!(!second.take(&p0, Some(&stale), &b, off(5)).await.unwrap());
    let released = directory.entries[&p0].clone();
    assert!(
        second
            .take(&p0, Some(&released), &b, off(42))
            .await
            .unwrap()
    );

    // A generation that lost an entry cannot hand it back.
    first
        .hand_back(&a, &PartitionOffsets::from([(p0.clone(), off(99))]))
        .await
        .unwrap();
    let directory = first.read().await.unwrap();
    assert_eq!(
        directory.entries[&p0],
        DirectoryEntry {
            owner: Some(b.clone()),
            start: off(42)
        }
    );

    // Taken from a holder that is gone, on the entry as read.
    let held = directory.entries[&p0].clone();
    let c = Generation::new("c", 1);
    assert!(first.take(&p0, Some(&held), &c, off(42)).await.unwrap());
    assert!(!second.take(&p0, Some(&held), &b, off(42)).await.unwrap());
}

#[tokio::test]
async fn a_generation_that_died_is_settled_from_its_log_and_its_log_removed() {
    let keyspace = sluice_tests::unique_name("group_log");
    let query = "orders";
    let mut directory = CassandraDirectory::open(location(&keyspace, query), options())
        .await
        .unwrap();
    let (p0, p1) = (TopicPartition::new("t", 0), TopicPartition::new("t", 1));
    let dead = Generation::new("dead", 3);
    assert!(directory.take(&p0, None, &dead, off(10)).await.unwrap());
    assert!(directory.take(&p1, None, &dead, off(20)).await.unwrap());

    // The generation committed one batch over partition 0 and planned another.
    let log = location(&keyspace, &dead.log_name(query));
    let mut its_store = CassandraStore::open(log.clone(), options()).await.unwrap();
    let plan = |id, from, until| {
        BatchPlan::from_offsets(
            BatchId(id),
            &PartitionOffsets::from([(p0.clone(), off(from)), (p1.clone(), off(20))]),
            &PartitionOffsets::from([(p0.clone(), off(until)), (p1.clone(), off(20))]),
            BatchMetadata::default(),
        )
        .unwrap()
    };
    its_store.write_plan(&plan(0, 10, 15)).await.unwrap();
    its_store
        .write_commit(&BatchCommit {
            id: BatchId(0),
            next_watermark_ms: 0,
        })
        .await
        .unwrap();
    its_store.write_plan(&plan(1, 15, 30)).await.unwrap();

    // Whoever settles it first fences it: the dead generation writes nothing more.
    let mut settler = CassandraStore::open(log.clone(), options()).await.unwrap();
    let fenced = its_store
        .write_commit(&BatchCommit {
            id: BatchId(1),
            next_watermark_ms: 0,
        })
        .await
        .unwrap_err();
    assert!(fenced.to_string().contains("taken over"), "{fenced}");

    let read = directory.read().await.unwrap();
    let unsettled = settler.load().await.unwrap();
    assert!(settled_ends(&read, &dead, &unsettled).is_err());
    // The replay of batch 1 commits it, and then its ends go back.
    settler
        .write_commit(&BatchCommit {
            id: BatchId(1),
            next_watermark_ms: 0,
        })
        .await
        .unwrap();
    let settled = settler.load().await.unwrap();
    let ends = settled_ends(&read, &dead, &settled).unwrap();
    assert_eq!(
        ends,
        PartitionOffsets::from([(p0.clone(), off(30)), (p1.clone(), off(20))])
    );
    directory.hand_back(&dead, &ends).await.unwrap();
    let read = directory.read().await.unwrap();
    assert_eq!(read.start_of(&p0), PartitionStart::At(off(30)));
    assert!(read.holders().is_empty());

    settler.remove().await.unwrap();
    let inspected = CassandraStore::inspect(log, options()).await.unwrap();
    assert!(inspected.is_none(), "the log is gone: {inspected:?}");
}

fn group(topic: &str, protocol: GroupProtocol) -> GroupConfig {
    GroupConfig {
        bootstrap_servers: sluice_tests::kafka_bootstrap(),
        group_id: sluice_tests::unique_name("group"),
        topics: vec![topic.to_owned()],
        protocol,
        client_options: [
            ("session.timeout.ms", "6000"),
            ("heartbeat.interval.ms", "500"),
        ]
        .into_iter()
        .filter(|_| protocol == GroupProtocol::Classic)
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
    }
}

/// Follows `member`'s changes until `until` holds of its assignment, keeping
/// each revocation it is handed until `hold` has passed.
async fn follow(
    member: &mut KafkaMembership,
    hold: Duration,
    until: impl Fn(&BTreeSet<TopicPartition>, &[(Instant, MembershipChange)]) -> bool,
) -> Vec<(Instant, MembershipChange)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    while !until(&member.assignment(), &seen) {
        assert!(
            Instant::now() < deadline,
            "no assignment as expected within 60 s: {:?}",
            member.assignment()
        );
        // The assignment changes after a revocation completes, with no change
        // to follow: look again now and then.
        let Ok(change) =
            tokio::time::timeout(Duration::from_millis(200), member.next_change()).await
        else {
            continue;
        };
        let change = change.unwrap();
        if let MembershipChange::Revoking(revocation) = change {
            let partitions = revocation.partitions.clone();
            tokio::time::sleep(hold).await;
            let at = Instant::now();
            revocation.complete();
            seen.push((
                at,
                MembershipChange::Revoking(Revocation::new(partitions, || {})),
            ));
        } else {
            seen.push((Instant::now(), change));
        }
    }
    seen
}

async fn members_share_partitions_and_wait_for_revocations(protocol: GroupProtocol) {
    let topic = sluice_tests::unique_name("group_members");
    sluice_tests::kafka::create_topic(&topic, 12).await;
    let config = group(&topic, protocol);
    let all: BTreeSet<TopicPartition> = (0..12)
        .map(|p| TopicPartition::new(topic.as_str(), p))
        .collect();

    let mut a = KafkaMembership::join(&config, "a").unwrap();
    follow(&mut a, Duration::ZERO, |held, _| held == &all).await;

    // A second member: the first gives up some partitions, and holds them
    // for 2 s before it lets them go; the second gets them only after.
    let mut b = KafkaMembership::join(&config, "b").unwrap();
    let hold = Duration::from_secs(2);
    let b_gets = tokio::spawn(async move {
        let seen = follow(&mut b, Duration::ZERO, |held, _| held.len() >= 5).await;
        (b, seen)
    });
    let seen_by_a = follow(&mut a, hold, |held, seen| {
        held.len() <= 7
            && seen
                .iter()
                .any(|(_, change)| matches!(change, MembershipChange::Revoking(_)))
    })
    .await;
    let (b, seen_by_b) = b_gets.await.unwrap();
    let released_at = seen_by_a
        .iter()
        .find_map(|(at, change)| matches!(change, MembershipChange::Revoking(_)).then_some(*at))
        .expect("the first member was asked to give partitions up");
    let revoked: BTreeSet<TopicPartition> = seen_by_a
        .iter()
        .filter_map(|(_, change)| match change {
            MembershipChange::Revoking(r) => Some(r.partitions.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    for (at, change) in &seen_by_b {
        if let MembershipChange::Assigned(given) = change
            && given.iter().any(|tp| revoked.contains(tp))
        {
            assert!(
                *at >= released_at,
                "the second member got {given:?} before the first let them go"
            );
        }
    }

    // Cooperative: what stays with the first member never moved, and the two
    // hold every partition exactly once between them.
    let (held_a, held_b) = (a.assignment(), b.assignment());
    assert!(held_a.is_disjoint(&held_b), "{held_a:?} and {held_b:?}");
    assert_eq!(held_a.union(&held_b).cloned().collect::<BTreeSet<_>>(), all);
    assert!(
        seen_by_a
            .iter()
            .all(|(_, change)| !matches!(change, MembershipChange::Assigned(_))),
        "the first member was given nothing back: {:?}",
        seen_by_a.iter().map(|(_, c)| c).collect::<Vec<_>>()
    );

    // A member that leaves hands its partitions to the other at once.
    b.leave().await;
    follow(&mut a, Duration::ZERO, |held, _| held == &all).await;
    a.leave().await;
    sluice_tests::kafka::delete_topic(&topic).await;
}

#[tokio::test]
async fn members_share_partitions_and_wait_for_revocations_with_the_classic_protocol() {
    members_share_partitions_and_wait_for_revocations(GroupProtocol::Classic).await;
}

#[tokio::test]
async fn members_share_partitions_and_wait_for_revocations_with_the_consumer_protocol() {
    members_share_partitions_and_wait_for_revocations(GroupProtocol::Consumer).await;
}
