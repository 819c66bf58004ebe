package io.pagedserve.client;

import io.grpc.Metadata;
import io.grpc.Status;
import java.time.Duration;
import java.util.OptionalLong;
import java.util.concurrent.ThreadLocalRandom;

/**
 * The retry policy of docs/api.md ("Retries"), the same in the Go, Java and Python clients.
 *
 * <ul>
 *   <li>UNAVAILABLE is retried only while the call has received no response message (for
 *       Generate: before the first token), after an exponential backoff {@code
 *       min(initialBackoff * multiplier^(retry-1), maxBackoff)}, less up to {@code jitter} of it
 *       at random.
 *   <li>RESOURCE_EXHAUSTED is retried only when the server sent a {@code retry-after} trailer
 *       (seconds), after exactly that long, and only if that is at most {@code maxRetryAfter}.
 *   <li>Nothing else is retried, and never once a response has arrived.
 *   <li>At most {@code maxAttempts} calls in all; a retry whose wait would pass the call's
 *       deadline is not made.
 * </ul>
 */
public final class RetryPolicy {
  static final Metadata.Key<String> RETRY_AFTER =
      Metadata.Key.of("retry-after", Metadata.ASCII_STRING_MARSHALLER);

  /** 4 attempts, backoff 0.1 s, 0.2 s, 0.4 s (up to 2 s), 20% jitter, retry-after up to 30 s. */
  public static final RetryPolicy DEFAULT =
      new RetryPolicy(4, Duration.ofMillis(100), Duration.ofSeconds(2), 2.0, 0.2, Duration.ofSeconds(30));

  /** Every call is a single attempt. */
  public static final RetryPolicy NONE =
      new RetryPolicy(1, Duration.ZERO, Duration.ZERO, 1.0, 0.0, Duration.ZERO);

  public final int maxAttempts;
  public final Duration initialBackoff;
  public final Duration maxBackoff;
  public final double multiplier;
  public final double jitter;
  public final Duration maxRetryAfter;

  public RetryPolicy(
      int maxAttempts,
      Duration initialBackoff,
      Duration maxBackoff,
      double multiplier,
      double jitter,
      Duration maxRetryAfter) {
    this.maxAttempts = maxAttempts;
    this.initialBackoff = initialBackoff;
    this.maxBackoff = maxBackoff;
    this.multiplier = multiplier;
    this.jitter = jitter;
    this.maxRetryAfter = maxRetryAfter;
  }

  /**
   * The wait in nanoseconds before retry number {@code retry} (1 for the first retry) after a
   * failure with {@code status} and {@code trailers}, or empty when it must not be retried.
   * {@code started}: whether the failed attempt had received a response message.
   */
  public OptionalLong delayNanos(int retry, boolean started, Status status, Metadata trailers) {
    if (started || retry >= maxAttempts) {
      return OptionalLong.empty();
    }
    switch (status.getCode()) {
      case UNAVAILABLE:
        double backoff = initialBackoff.toNanos() * Math.pow(multiplier, retry - 1);
        backoff = Math.min(backoff, maxBackoff.toNanos());
        return OptionalLong.of((long) (backoff * (1 - jitter * ThreadLocalRandom.current().nextDouble())));
      case RESOURCE_EXHAUSTED:
        String value = trailers == null ? null : trailers.get(RETRY_AFTER);
        if (value == null) {
          return OptionalLong.empty();
        }
        double seconds;
        try {
          seconds = Double.parseDouble(value.trim());
        } catch (NumberFormatException e) {
          return OptionalLong.empty();
        }
        long wait = (long) (seconds * 1e9);
        if (seconds < 0 || wait > maxRetryAfter.toNanos()) {
          return OptionalLong.empty();
        }
        return OptionalLong.of(wait);
      default:
        return OptionalLong.empty();
    }
  }
}
