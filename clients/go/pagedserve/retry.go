package pagedserve

import (
	"context"
	"math"
	"math/rand"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// RetryPolicy is the retry policy of docs/api.md ("Retries"), the same in the Go, Java and
// Python clients:
//
//   - UNAVAILABLE is retried only while the call has received no response message (for
//     Generate: before the first token), after an exponential backoff:
//     min(InitialBackoff * Multiplier^(retry-1), MaxBackoff), less up to Jitter of it at random.
//   - RESOURCE_EXHAUSTED is retried only when the server sent a "retry-after" trailer (seconds),
//     after exactly that long, and only if that is at most MaxRetryAfter.
//   - Nothing else is retried, and never once a response has arrived.
//   - At most MaxAttempts calls in all; a retry whose wait would pass the deadline is not made.
type RetryPolicy struct {
	MaxAttempts    int
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	Multiplier     float64
	Jitter         float64
	MaxRetryAfter  time.Duration
}

// DefaultRetryPolicy: 4 attempts, backoff 0.1 s, 0.2 s, 0.4 s (up to 2 s), 20% jitter, a
// retry-after of up to 30 s honoured.
var DefaultRetryPolicy = RetryPolicy{
	MaxAttempts:    4,
	InitialBackoff: 100 * time.Millisecond,
	MaxBackoff:     2 * time.Second,
	Multiplier:     2,
	Jitter:         0.2,
	MaxRetryAfter:  30 * time.Second,
}

// NoRetry makes every call a single attempt.
var NoRetry = RetryPolicy{MaxAttempts: 1}

// Delay is the wait before retry number `retry` (1 for the first retry) after err, or false
// when err must not be retried. started: whether the failed attempt had received a response.
func (p RetryPolicy) Delay(retry int, started bool, err error, trailer metadata.MD) (time.Duration, bool) {
	if started || retry >= p.MaxAttempts {
		return 0, false
	}
	switch status.Code(err) {
	case codes.Unavailable:
		backoff := float64(p.InitialBackoff) * math.Pow(p.Multiplier, float64(retry-1))
		backoff = math.Min(backoff, float64(p.MaxBackoff))
		return time.Duration(backoff * (1 - p.Jitter*rand.Float64())), true
	case codes.ResourceExhausted:
		values := trailer.Get("retry-after")
		if len(values) == 0 {
			return 0, false
		}
		seconds, perr := strconv.ParseFloat(values[0], 64)
		wait := time.Duration(seconds * float64(time.Second))
		if perr != nil || seconds < 0 || wait > p.MaxRetryAfter {
			return 0, false
		}
		return wait, true
	}
	return 0, false
}

// run makes attempts until one succeeds or the policy says stop; attempt reports whether it
// received a response, the trailer of its failure and the error.
func (p RetryPolicy) run(ctx context.Context, attempt func(context.Context) (bool, metadata.MD, error)) error {
	for retry := 1; ; retry++ {
		started, trailer, err := attempt(ctx)
		if err == nil {
			return nil
		}
		wait, ok := p.Delay(retry, started, err, trailer)
		if !ok {
			return err
		}
		if deadline, has := ctx.Deadline(); has && time.Until(deadline) <= wait {
			return err
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			if ctx.Err() == context.DeadlineExceeded {
				return status.Error(codes.DeadlineExceeded, ctx.Err().Error())
			}
			return status.Error(codes.Canceled, ctx.Err().Error())
		case <-timer.C:
		}
	}
}
