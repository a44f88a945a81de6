//! Keeps producing sample order events to a topic, creating it (4 partitions) if
//! it is missing, until interrupted. Used by `cargo xtask demo`. Orders are JSON;
//! one in 250 is cut short, so that the demo shows a bad record going to the
//! dead letters. Given a returns topic, one order in 10 is also returned there,
//! as a CSV line `order,customer,item,quantity,price`: a second stream, in
//! another format.
//!
//! ```text
//! cargo run -p sluice-examples --example demo_producer -- [bootstrap] [topic] [events per second] [returns topic]
//! ```

use std::time::Duration;

use anyhow::{Context, Result};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let bootstrap = args.next().unwrap_or_else(|| "127.0.0.1:9092".to_owned());
    let topic = args.next().unwrap_or_else(|| "demo-orders".to_owned());
    let rate: u64 = args
        .next()
        .map(|r| r.parse())
        .transpose()
        .context("events per second must be a number")?
        .unwrap_or(500);
    let returns = args.next();

    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &bootstrap);
    let admin: AdminClient<DefaultClientContext> = config.create()?;
    let mut new_topics = vec![NewTopic::new(&topic, 4, TopicReplication::Fixed(1))];
    if let Some(returns) = &returns {
        new_topics.push(NewTopic::new(returns, 2, TopicReplication::Fixed(1)));
    }
    // An existing topic is fine: the demo may run again.
    let _ = admin
        .create_topics(&new_topics, &AdminOptions::new())
        .await?;

    let producer: FutureProducer = config.clone().set("linger.ms", "20").create()?;
    let customers = ["ada", "grace", "edsger", "barbara", "ken", "margaret"];
    let items = [
        ("book", 12.5),
        ("lamp", 34.0),
        ("chair", 79.9),
        ("kettle", 25.0),
        ("desk", 189.0),
    ];
    let tick = Duration::from_millis(100);
    let per_tick = (rate / 10).max(1);
    println!("producing about {rate} events/s to {topic} on {bootstrap}; Ctrl-C stops");
    let mut n: u64 = 0;
    loop {
        for _ in 0..per_tick {
            let customer = customers[(n % customers.len() as u64) as usize];
            let (item, price) = items[(n / 7 % items.len() as u64) as usize];
            let mut value = format!(
                "{{\"order\":{n},\"customer\":\"{customer}\",\"item\":\"{item}\",\"quantity\":{},\"price\":{price}}}",
                n % 5 + 1
            );
            if n % 250 == 249 {
                value.truncate(value.len() / 2);
            }
            let record = FutureRecord::to(&topic).key(customer).payload(&value);
            if let Err((e, _)) = producer.send_result(record) {
                eprintln!("demo producer: queueing failed: {e}");
                producer.flush(Duration::from_secs(5))?;
            }
            // One in ten, of every customer (odd and even numbers).
            if let Some(returns) = returns.as_deref().filter(|_| matches!(n % 20, 3 | 16)) {
                let line = format!("{n},{customer},{item},{},{price}", n % 5 + 1);
                let record = FutureRecord::to(returns).key(customer).payload(&line);
                if let Err((e, _)) = producer.send_result(record) {
                    eprintln!("demo producer: queueing a return failed: {e}");
                    producer.flush(Duration::from_secs(5))?;
                }
            }
            n += 1;
        }
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    producer.flush(Duration::from_secs(10))?;
    println!("produced {n} events");
    Ok(())
}
