// Command pagedserve-generate streams one generation from a pagedserve server and prints the
// text as it arrives; Ctrl-C cancels the request (the server frees its KV blocks).
//
//	pagedserve-generate --address 127.0.0.1:50051 --max-tokens 64 "The capital of France is"
//	pagedserve-generate --chat "What is the capital of France?"
//	pagedserve-generate --model my-alias "Hello"   # one of the server's --served-model-name names
//	echo "Prompt from stdin" | pagedserve-generate -
//
// Exit status: 0 done, 1 the server (or the deadline) ended the call ("error: CODE: message"
// on stderr), 2 bad flags, 130 cancelled by Ctrl-C.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pagedserve/pagedserve/clients/go/pagedserve"
	pb "github.com/pagedserve/pagedserve/clients/go/pagedservev1"
)

func main() {
	os.Exit(run())
}

func run() int {
	address := flag.String("address", "127.0.0.1:50051", "the control plane's gRPC address")
	model := flag.String("model", "", "model name to ask for: one of the server's --served-model-name names; "+
		"the server refuses any other with NOT_FOUND (default: the served model)")
	maxTokens := flag.Uint("max-tokens", 128, "most tokens to generate")
	temperature := flag.Float64("temperature", 0, "sampling temperature (0: greedy)")
	chat := flag.Bool("chat", false, "send the prompt as a user chat message")
	timeout := flag.Float64("timeout", 0, "deadline in seconds (0: none)")
	apiKey := flag.String("api-key", os.Getenv("PAGEDSERVE_API_KEY"), "API key (default $PAGEDSERVE_API_KEY)")
	useTLS := flag.Bool("tls", false, "connect over TLS (system roots)")
	caFile := flag.String("tls-ca-file", "", "connect over TLS, verifying the server with this CA")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: %s [flags] PROMPT (- reads it from stdin)\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		return 2
	}
	prompt := flag.Arg(0)
	if prompt == "-" {
		data, err := io.ReadAll(os.Stdin)
		if err != nil {
			fmt.Fprintln(os.Stderr, "error: reading stdin:", err)
			return 2
		}
		prompt = string(data)
	}

	// Ctrl-C (or SIGTERM) cancels the context, which cancels the call on the server.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	client, err := pagedserve.Dial(*address, pagedserve.Config{
		APIKey:  *apiKey,
		TLS:     *useTLS,
		CAFile:  *caFile,
		Timeout: time.Duration(*timeout * float64(time.Second)),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		return 1
	}
	defer client.Close()

	params := pagedserve.Sampled(uint32(*maxTokens), float32(*temperature))
	req := pagedserve.TextRequest(prompt, params)
	if *chat {
		req = pagedserve.ChatRequest([]*pb.ChatMessage{pagedserve.User(prompt)}, params)
	}
	req.Model = *model // "": unset, the server's served model
	completions, err := client.Stream(ctx, req, func(chunk *pb.TokenChunk) {
		os.Stdout.WriteString(chunk.Text) // unbuffered: each chunk shows as it arrives
	})
	if err != nil {
		if ctx.Err() != nil && errors.Is(ctx.Err(), context.Canceled) && status.Code(err) == codes.Canceled {
			fmt.Fprintln(os.Stderr, "\ncancelled")
			return 130
		}
		fmt.Fprintln(os.Stderr, "\nerror:", pagedserve.Describe(err))
		return 1
	}
	fmt.Println()
	for _, c := range completions {
		fmt.Fprintf(os.Stderr, "[%s; %d prompt (%d cached) + %d generated tokens; ttft %.0f ms, total %.2f s]\n",
			finishName(c.FinishReason), c.Usage.GetPromptTokens(), c.Usage.GetCachedTokens(),
			c.Usage.GetCompletionTokens(), c.Timings.GetTimeToFirstTokenSeconds()*1000, c.Timings.GetE2ESeconds())
	}
	return 0
}

func finishName(r pb.FinishReason) string {
	switch r {
	case pb.FinishReason_FINISH_REASON_STOP:
		return "stop"
	case pb.FinishReason_FINISH_REASON_LENGTH:
		return "length"
	case pb.FinishReason_FINISH_REASON_ABORT:
		return "abort"
	}
	return "unknown"
}
