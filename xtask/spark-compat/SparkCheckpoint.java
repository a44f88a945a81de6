// Writes and reads streaming checkpoints with Spark's own checkpoint classes
// (StreamMetadata, OffsetSeqLog, CommitLog), so that Sluice's tests can check
// that each side reads what the other writes. Run with Java's single-file
// launcher by `cargo xtask spark-compat`.
//
//   SparkCheckpoint write <dir> <batches> <committed> <topic>
//       a query id, <batches> plans where plan b ends at 100*(b+1) on partitions
//       0..2 of <topic>, and commits for the first <committed> batches
//   SparkCheckpoint read <dir>
//       prints every entry Spark reads, one per line:
//       SPARK id=<id>
//       SPARK offsets batch=<b> watermark=<ms> timestamp=<ms> shuffle=<conf value> source=<json>
//       SPARK commit batch=<b> nextBatchWatermarkMs=<ms>

import java.util.List;

import org.apache.hadoop.fs.Path;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.connector.read.streaming.Offset;
import org.apache.spark.sql.execution.streaming.CommitLog;
import org.apache.spark.sql.execution.streaming.CommitMetadata;
import org.apache.spark.sql.execution.streaming.OffsetSeq;
import org.apache.spark.sql.execution.streaming.OffsetSeqLog;
import org.apache.spark.sql.execution.streaming.OffsetSeqMetadata;
import org.apache.spark.sql.execution.streaming.SerializedOffset;
import org.apache.spark.sql.execution.streaming.StreamMetadata;
import org.apache.spark.sql.execution.streaming.StreamMetadata$;
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
        OffsetSeqLog offsets = new OffsetSeqLog(spark, dir + "/offsets");
        CommitLog commits = new CommitLog(spark, dir + "/commits");
        Path metadata = new Path(dir, "metadata");
        org.apache.hadoop.conf.Configuration hadoop = spark.sessionState().newHadoopConf();

        switch (args[0]) {
            case "write" -> {
                int batches = Integer.parseInt(args[2]);
                int committed = Integer.parseInt(args[3]);
                String topic = args[4];
                StreamMetadata$.MODULE$.write(new StreamMetadata("0b5e3d4c-spark-written"), metadata, hadoop);
                for (int b = 0; b < batches; b++) {
                    long end = 100L * (b + 1);
                    String json = "{\"" + topic + "\":{\"0\":" + end + ",\"1\":" + end + ",\"2\":" + end + "}}";
                    String meta = "{\"batchWatermarkMs\":" + b + ",\"batchTimestampMs\":" + (1700000000000L + b)
                        + ",\"conf\":{\"spark.sql.shuffle.partitions\":\"200\"}}";
                    List<Offset> sources = List.of(new SerializedOffset(json));
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
                Option<scala.Tuple2<Object, OffsetSeq>> latest = offsets.getLatest();
                long last = latest.isDefined() ? (Long) latest.get()._1() : -1;
                for (long b = 0; b <= last; b++) {
                    Option<OffsetSeq> seq = offsets.get(b);
                    if (seq.isEmpty()) {
                        continue;
                    }
                    OffsetSeqMetadata md = seq.get().metadata().get();
                    Offset source = seq.get().offsets().head().get();
                    System.out.println("SPARK offsets batch=" + b + " watermark=" + md.batchWatermarkMs()
                        + " timestamp=" + md.batchTimestampMs()
                        + " shuffle=" + md.conf().getOrElse("spark.sql.shuffle.partitions", () -> "unset")
                        + " source=" + source.json());
                }
                Option<scala.Tuple2<Object, CommitMetadata>> latestCommit = commits.getLatest();
                long lastCommit = latestCommit.isDefined() ? (Long) latestCommit.get()._1() : -1;
                for (long b = 0; b <= lastCommit; b++) {
                    Option<CommitMetadata> commit = commits.get(b);
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

    private static void check(boolean added, String what) {
        if (!added) {
            throw new IllegalStateException(what + " already existed");
        }
    }
}
