// Writes and reads streaming checkpoints with Spark's own checkpoint classes
// (StreamMetadata, OffsetSeqLog, CommitLog, and the Kafka source's
// KafkaSourceInitialOffsetWriter and KafkaSourceOffset), so that Sluice's tests
// can check that each side reads what the other writes. Run with Java's
// single-file launcher by `cargo xtask spark-compat`.
//
//   SparkCheckpoint write <dir> <batches> <committed> <topic>[,<topic>...]
//       a query id, and a Kafka source per topic, in order: initial offsets 0
//       on partitions 0..2 of its topic, <batches> plans where plan b ends at
//       100*(b+1) on every source, and commits for the first <committed>
//       batches
//   SparkCheckpoint read <dir>
//       prints every entry Spark reads, one per line, offsets as the Kafka
//       source parsed them, sorted, the sources apart by " | " in their order:
//       SPARK id=<id>
//       SPARK initial <topic>-<p>=<offset> ... [| ...]
//       SPARK offsets batch=<b> watermark=<ms> timestamp=<ms> shuffle=<conf value> <topic>-<p>=<offset> ... [| ...]
//       SPARK commit batch=<b> nextBatchWatermarkMs=<ms>
//   SparkCheckpoint table <dir>
//       reads the table at <dir> as Spark reads a file sink's output (through
//       its _spark_metadata log) and prints each file it read and each row:
//       SPARK file <uri>
//       SPARK row <row as JSON>

import java.util.ArrayList;
import java.util.List;

import org.apache.hadoop.fs.Path;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.connector.read.streaming.Offset;
import org.apache.spark.sql.execution.streaming.checkpointing.CommitLog;
import org.apache.spark.sql.execution.streaming.checkpointing.CommitMetadata;
import org.apache.spark.sql.execution.streaming.checkpointing.CommitMetadataBase;
import org.apache.spark.sql.execution.streaming.checkpointing.OffsetSeq;
import org.apache.spark.sql.execution.streaming.checkpointing.OffsetSeqBase;
import org.apache.spark.sql.execution.streaming.checkpointing.OffsetSeqLog;
import org.apache.spark.sql.execution.streaming.checkpointing.OffsetSeqMetadataBase;
import org.apache.spark.sql.execution.streaming.runtime.SerializedOffset;
import org.apache.spark.sql.execution.streaming.runtime.StreamMetadata;
import org.apache.spark.sql.execution.streaming.runtime.StreamMetadata$;
import org.apache.spark.sql.kafka010.KafkaSourceInitialOffsetWriter;
import org.apache.spark.sql.kafka010.KafkaSourceOffset;
import org.apache.spark.sql.kafka010.KafkaSourceOffset$;
import scala.Option;
import scala.jdk.javaapi.CollectionConverters;

public class SparkCheckpoint {
    public static void main(String[] args) throws Exception {
        SparkSession spark = SparkSession.builder()
            .master("local[1]")
            .appName("sluice-spark-checkpoint")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .getOrCreate();
        spark.sparkContext().setLogLevel("WARN");
        String dir = args[1];
        if (args[0].equals("table")) {
            org.apache.spark.sql.Dataset<org.apache.spark.sql.Row> table = spark.read().parquet(dir);
            for (String file : table.inputFiles()) {
                System.out.println("SPARK file " + file);
            }
            for (String row : table.toJSON().collectAsList()) {
                System.out.println("SPARK row " + row);
            }
            System.out.flush();
            spark.stop();
            return;
        }
        // The third argument keeps Spark's own default (the Scala default
        // parameter, which Java has to ask for by name).
        OffsetSeqLog offsets = new OffsetSeqLog(spark, dir + "/offsets", OffsetSeqLog.$lessinit$greater$default$3());
        CommitLog commits = new CommitLog(spark, dir + "/commits", CommitLog.$lessinit$greater$default$3());
        Path metadata = new Path(dir, "metadata");
        org.apache.hadoop.conf.Configuration hadoop = spark.sessionState().newHadoopConf();

        switch (args[0]) {
            case "write" -> {
                int batches = Integer.parseInt(args[2]);
                int committed = Integer.parseInt(args[3]);
                String[] topics = args[4].split(",");
                StreamMetadata$.MODULE$.write(new StreamMetadata("0b5e3d4c-spark-written"), metadata, hadoop);
                for (int i = 0; i < topics.length; i++) {
                    check(initialWriter(spark, dir, i).add(0, kafka(topics[i], 0)), "initial offsets " + i);
                }
                for (int b = 0; b < batches; b++) {
                    String meta = "{\"batchWatermarkMs\":" + b + ",\"batchTimestampMs\":" + (1700000000000L + b)
                        + ",\"conf\":{\"spark.sql.shuffle.partitions\":\"200\"}}";
                    List<Offset> sources = new ArrayList<>();
                    for (String topic : topics) {
                        // Rendered by the Kafka source's own JSON writer.
                        sources.add(new SerializedOffset(kafka(topic, 100L * (b + 1)).json()));
                    }
                    OffsetSeq seq = OffsetSeq.fill(Option.apply(meta), CollectionConverters.asScala(sources).toSeq());
                    check(offsets.add(b, seq), "offsets " + b);
                    if (b < committed) {
                        check(commits.add(b, new CommitMetadata(b)), "commit " + b);
                    }
                }
            }
            case "read" -> {
                Option<StreamMetadata> id = StreamMetadata$.MODULE$.read(metadata, hadoop);
                System.out.println("SPARK id=" + (id.isDefined() ? id.get().id() : "none"));
                List<String> starts = new ArrayList<>();
                org.apache.hadoop.fs.FileSystem fs = metadata.getFileSystem(hadoop);
                for (int i = 0; fs.exists(new Path(dir, "sources/" + i + "/0")); i++) {
                    Option<KafkaSourceOffset> start = initialWriter(spark, dir, i).get(0);
                    starts.add(start.isDefined() ? sorted(start.get()) : "-");
                }
                if (!starts.isEmpty()) {
                    System.out.println("SPARK initial " + String.join(" | ", starts));
                }
                Option<scala.Tuple2<Object, OffsetSeqBase>> latest = offsets.getLatest();
                long last = latest.isDefined() ? (Long) latest.get()._1() : -1;
                for (long b = 0; b <= last; b++) {
                    Option<OffsetSeqBase> seq = offsets.get(b);
                    if (seq.isEmpty()) {
                        continue;
                    }
                    OffsetSeqMetadataBase md = seq.get().metadataOpt().get();
                    List<String> lines = new ArrayList<>();
                    for (Option<Offset> source : CollectionConverters.asJava(seq.get().offsets())) {
                        lines.add(source.isDefined()
                            ? sorted(KafkaSourceOffset$.MODULE$.apply(new SerializedOffset(source.get().json())))
                            : "-");
                    }
                    System.out.println("SPARK offsets batch=" + b + " watermark=" + md.batchWatermarkMs()
                        + " timestamp=" + md.batchTimestampMs()
                        + " shuffle=" + md.conf().getOrElse("spark.sql.shuffle.partitions", () -> "unset")
                        + " " + String.join(" | ", lines));
                }
                Option<scala.Tuple2<Object, CommitMetadataBase>> latestCommit = commits.getLatest();
                long lastCommit = latestCommit.isDefined() ? (Long) latestCommit.get()._1() : -1;
                for (long b = 0; b <= lastCommit; b++) {
                    Option<CommitMetadataBase> commit = commits.get(b);
                    if (commit.isDefined()) {
                        System.out.println("SPARK commit batch=" + b + " nextBatchWatermarkMs="
                            + commit.get().nextBatchWatermarkMs());
                    }
                }
            }
            default -> throw new IllegalArgumentException("unknown mode " + args[0]);
        }
        System.out.flush();
        spark.stop();
    }

    /** The initial offsets of source `index`, as the Kafka source keeps them. */
    private static KafkaSourceInitialOffsetWriter initialWriter(SparkSession spark, String dir, int index) {
        return new KafkaSourceInitialOffsetWriter(spark, dir + "/sources/" + index);
    }

    /** Offsets of partitions 0..2 of a topic, all at `offset`, parsed by the Kafka source. */
    private static KafkaSourceOffset kafka(String topic, long offset) {
        String json = "{\"" + topic + "\":{\"0\":" + offset + ",\"1\":" + offset + ",\"2\":" + offset + "}}";
        return KafkaSourceOffset$.MODULE$.apply(new SerializedOffset(json));
    }

    /** `topic-partition=offset` pairs, sorted by topic, then partition number. */
    private static String sorted(KafkaSourceOffset offset) {
        List<String> pairs = new ArrayList<>();
        CollectionConverters.asJava(offset.partitionToOffsets()).entrySet().stream()
            .sorted((a, b) -> {
                int byTopic = a.getKey().topic().compareTo(b.getKey().topic());
                return byTopic != 0 ? byTopic : Integer.compare(a.getKey().partition(), b.getKey().partition());
            })
            .forEach(e -> pairs.add(e.getKey() + "=" + e.getValue()));
        return String.join(" ", pairs);
    }

    private static void check(boolean added, String what) {
        if (!added) {
            throw new IllegalStateException(what + " already existed");
        }
    }
}
