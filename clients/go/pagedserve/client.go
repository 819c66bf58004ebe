// Package pagedserve is a small typed client for pagedserve's GenerationService: streaming
// generation, tokenize, detokenize and list models, with a deadline, an API key and TLS.
//
//	client, err := pagedserve.Dial("127.0.0.1:50051", pagedserve.Config{Timeout: time.Minute})
//	if err != nil { ... }
//	defer client.Close()
//	req := pagedserve.TextRequest("The capital of France is", pagedserve.Greedy(32))
//	out, err := client.Stream(ctx, req, func(c *pb.TokenChunk) { fmt.Print(c.Text) })
//
// Structured outputs (WithJSONSchema, WithChoice, ...) constrain a request's sampling parameters;
// tool calling (WithTools, WithToolChoice, ...) declares functions on a chat request, and each
// Completion then has ToolCalls and Content.
//
// Errors are gRPC status errors: status.Code(err) is the server's code, status.Convert(err).Message()
// its message (naming the offending field for INVALID_ARGUMENT). Calls retry as docs/api.md says:
// UNAVAILABLE only before the first response, RESOURCE_EXHAUSTED after the server's retry-after.
package pagedserve

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"sort"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"

	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

// Config says how to reach the server. The zero value is a plaintext connection without a key.
type Config struct {
	// APIKey, when set, is sent as "authorization: Bearer <APIKey>" metadata on every call.
	APIKey string
	// TLS connects over TLS, verifying the server against the system's roots.
	TLS bool
	// CAFile connects over TLS, verifying the server against this PEM CA (implies TLS).
	CAFile string
	// Timeout is the deadline of a call whose context has none (0: no deadline). Retries
	// happen inside the same deadline.
	Timeout time.Duration
	// Retry is the retry policy; nil means DefaultRetryPolicy. Use &NoRetry to disable retries.
	Retry *RetryPolicy
}

// Client calls one pagedserve control plane. It is safe for concurrent use.
type Client struct {
	conn   *grpc.ClientConn
	stub   pb.GenerationServiceClient
	config Config
	retry  RetryPolicy
}

// Dial connects to target ("host:port"). The connection is made lazily, on the first call.
func Dial(target string, config Config) (*Client, error) {
	transport := grpc.WithInsecure()
	switch {
	case config.CAFile != "":
		creds, err := credentials.NewClientTLSFromFile(config.CAFile, "")
		if err != nil {
			return nil, fmt.Errorf("pagedserve: CA file: %w", err)
		}
		transport = grpc.WithTransportCredentials(creds)
	case config.TLS:
		transport = grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS12}))
	}
	conn, err := grpc.Dial(target, transport, grpc.WithUserAgent("pagedserve-go"))
	if err != nil {
		return nil, err
	}
	retry := DefaultRetryPolicy
	if config.Retry != nil {
		retry = *config.Retry
	}
	return &Client{conn: conn, stub: pb.NewGenerationServiceClient(conn), config: config, retry: retry}, nil
}

// Close closes the connection; calls in flight fail with CANCELED.
func (c *Client) Close() error { return c.conn.Close() }

// Stub is the generated stub on the same connection, for what this package does not wrap.
// Its calls carry neither the API key nor the default deadline nor retries.
func (c *Client) Stub() pb.GenerationServiceClient { return c.stub }

// Completion is one finished completion: its text and token ids (the chunks of its index
// concatenated) and the final message's details.
type Completion struct {
	RequestID    string
	Index        uint32
	FinishReason pb.FinishReason
	StopString   string
	Text         string
	TokenIDs     []uint32
	Usage        *pb.Usage
	Timings      *pb.Timings
	// ToolCalls are the calls the completion made (a request with tools and a tool choice
	// other than none), parsed from Text: Id, Name and Arguments (JSON text). Send them back
	// in Assistant(Content, ToolCalls...) and each result in ToolResult(call.Id, ...).
	ToolCalls []*pb.ToolCall
	// Content is, with tools, the completion's text outside its tool calls.
	Content string
}

// FinishReasonName is "stop", "length", "abort", "tool_calls" or "unknown".
func (c Completion) FinishReasonName() string { return FinishReasonName(c.FinishReason) }

// call returns the context of one logical call: the default deadline when ctx has none, and
// the API key as metadata.
func (c *Client) call(ctx context.Context) (context.Context, context.CancelFunc) {
	cancel := context.CancelFunc(func() {})
	if _, ok := ctx.Deadline(); !ok && c.config.Timeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, c.config.Timeout)
	}
	if c.config.APIKey != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.config.APIKey)
	}
	return ctx, cancel
}

// Stream sends req and calls onChunk (when not nil) with each chunk as it arrives, then
// returns one Completion per index, in index order. Cancelling ctx (or its deadline passing)
// aborts the request on the server and frees its KV blocks; the error is then CANCELED or
// DEADLINE_EXCEEDED.
func (c *Client) Stream(ctx context.Context, req *pb.GenerateRequest, onChunk func(*pb.TokenChunk)) ([]Completion, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	var result []Completion
	err := c.retry.run(ctx, func(ctx context.Context) (bool, metadata.MD, error) {
		ctx, stop := context.WithCancel(ctx)
		defer stop() // ends the stream if onChunk panics or the loop returns early
		stream, err := c.stub.Generate(ctx, req)
		if err != nil {
			return false, nil, err
		}
		text := map[uint32][]byte{}
		tokens := map[uint32][]uint32{}
		done := map[uint32]Completion{}
		started := false
		for {
			resp, err := stream.Recv()
			if err == io.EOF {
				result = make([]Completion, 0, len(done))
				for _, d := range done {
					result = append(result, d)
				}
				sort.Slice(result, func(i, j int) bool { return result[i].Index < result[j].Index })
				return started, nil, nil
			}
			if err != nil {
				return started, stream.Trailer(), err
			}
			started = true
			if chunk := resp.GetChunk(); chunk != nil {
				text[chunk.Index] = append(text[chunk.Index], chunk.Text...)
				tokens[chunk.Index] = append(tokens[chunk.Index], chunk.TokenIds...)
				if onChunk != nil {
					onChunk(chunk)
				}
			} else if end := resp.GetComplete(); end != nil {
				done[end.Index] = Completion{
					RequestID:    resp.RequestId,
					Index:        end.Index,
					FinishReason: end.FinishReason,
					StopString:   end.StopString,
					Text:         string(text[end.Index]),
					TokenIDs:     tokens[end.Index],
					Usage:        end.Usage,
					Timings:      end.Timings,
					ToolCalls:    end.ToolCalls,
					Content:      end.Content,
				}
			}
		}
	})
	return result, err
}

// Generate is Stream without a chunk callback.
func (c *Client) Generate(ctx context.Context, req *pb.GenerateRequest) ([]Completion, error) {
	return c.Stream(ctx, req, nil)
}

// unary runs one unary call under the client's deadline, key and retry policy.
func unary[Req, Resp any](c *Client, ctx context.Context, rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	ctx, cancel := c.call(ctx)
	defer cancel()
	var out Resp
	err := c.retry.run(ctx, func(ctx context.Context) (bool, metadata.MD, error) {
		var trailer metadata.MD
		resp, err := rpc(ctx, req, grpc.Trailer(&trailer))
		if err != nil {
			return false, trailer, err
		}
		out = resp
		return true, nil, nil
	})
	return out, err
}

// Tokenize returns the token ids of a plain-text prompt.
func (c *Client) Tokenize(ctx context.Context, text string) ([]uint32, error) {
	req := &pb.TokenizeRequest{Prompt: &pb.TokenizeRequest_Text{Text: text}}
	resp, err := unary(c, ctx, c.stub.Tokenize, req)
	if err != nil {
		return nil, err
	}
	return resp.TokenIds, nil
}

// TokenizeChat returns the token ids of a chat prompt (chat template applied).
func (c *Client) TokenizeChat(ctx context.Context, messages ...*pb.ChatMessage) ([]uint32, error) {
	req := &pb.TokenizeRequest{Prompt: &pb.TokenizeRequest_Chat{Chat: &pb.ChatMessages{Messages: messages}}}
	resp, err := unary(c, ctx, c.stub.Tokenize, req)
	if err != nil {
		return nil, err
	}
	return resp.TokenIds, nil
}

// Detokenize returns the text of token ids.
func (c *Client) Detokenize(ctx context.Context, ids []uint32) (string, error) {
	resp, err := unary(c, ctx, c.stub.Detokenize, &pb.DetokenizeRequest{TokenIds: ids})
	if err != nil {
		return "", err
	}
	return resp.Text, nil
}

// ListModels returns the model names the server answers to, with the model's limits.
func (c *Client) ListModels(ctx context.Context) ([]*pb.ModelCard, error) {
	resp, err := unary(c, ctx, c.stub.ListModels, &pb.ListModelsRequest{})
	if err != nil {
		return nil, err
	}
	return resp.Models, nil
}
