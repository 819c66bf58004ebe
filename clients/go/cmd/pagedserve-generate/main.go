// Command pagedserve-generate streams one generation from a pagedserve server and prints the
// text as it arrives; Ctrl-C cancels the request (the server frees its KV blocks).
//
//	pagedserve-generate --address 127.0.0.1:50051 --max-tokens 64 "The capital of France is"
//	pagedserve-generate --chat "What is the capital of France?"
//	pagedserve-generate --model my-alias "Hello"   # one of the server's --served-model-name names
//	echo "Prompt from stdin" | pagedserve-generate -
//
// Structured outputs (at most one of the flags; @FILE reads the schema or grammar from a file):
//
//	pagedserve-generate --chat --json-schema '{"type":"object","properties":{"name":{"type":"string"}},"required":["name"]}' "A person as JSON"
//	pagedserve-generate --json-schema @person.schema.json "A person as JSON:"
//	pagedserve-generate --choice yes --choice no "Is the sky blue? Answer:"
//	pagedserve-generate --json-object / --regex '[0-9]{3}' / --grammar @arith.gbnf ...
//
// Tool calling (with --chat): --tool is OpenAI's function object (or {"type": "function",
// "function": {...}}), its JSON text or @FILE, repeatable; --tool-choice none, auto, required or
// function:NAME; --no-parallel-tool-calls allows one call per completion. After the text, one
// JSON line per completion: {"index", "finish_reason", "content", "tool_calls": [{"id", "name",
// "arguments"}]} (arguments as JSON text).
//
//	pagedserve-generate --chat --tool-choice required \
//	  --tool '{"name":"get_weather","description":"The weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}' \
//	  "What is the weather in Paris?"
//
// Exit status: 0 done, 1 the server (or the deadline) ended the call ("error: CODE: message"
// on stderr), 2 bad flags, 130 cancelled by Ctrl-C.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
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

// repeated is a flag that may be given several times (--choice yes --choice no).
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ",") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

// textOrFile is a flag's text, or the contents of FILE for "@FILE".
func textOrFile(value string) (string, error) {
	if !strings.HasPrefix(value, "@") {
		return value, nil
	}
	data, err := os.ReadFile(value[1:])
	return string(data), err
}

// constrain sets at most one constraint on params from the flags that were given; more than
// one is an error naming them.
func constrain(params *pb.SamplingParams, set map[string]bool, jsonSchema, regex, grammar string, choices []string) error {
	var given []string
	for _, name := range []string{"json-schema", "json-object", "regex", "choice", "grammar"} {
		if set[name] {
			given = append(given, "--"+name)
		}
	}
	if len(given) > 1 {
		return fmt.Errorf("at most one constraint flag, got %s", strings.Join(given, " and "))
	}
	switch {
	case set["json-schema"]:
		text, err := textOrFile(jsonSchema)
		if err != nil {
			return err
		}
		pagedserve.WithJSONSchema(params, text)
	case set["json-object"]:
		pagedserve.WithJSONObject(params)
	case set["regex"]:
		pagedserve.WithRegex(params, regex)
	case set["choice"]:
		pagedserve.WithChoice(params, choices...)
	case set["grammar"]:
		text, err := textOrFile(grammar)
		if err != nil {
			return err
		}
		pagedserve.WithGrammar(params, text)
	}
	return nil
}

// toolsFor sets the tools, tool choice and parallel flag of a chat request from the tool flags.
func toolsFor(req *pb.GenerateRequest, tools []string, choice string, noParallel bool) error {
	for _, value := range tools {
		text, err := textOrFile(value)
		if err != nil {
			return fmt.Errorf("--tool: %w", err)
		}
		tool, err := pagedserve.ToolFromJSON(text)
		if err != nil {
			return fmt.Errorf("--tool %s: %w", value, err)
		}
		pagedserve.WithTools(req, tool)
	}
	switch {
	case choice == "":
	case choice == "none":
		pagedserve.WithToolChoice(req, pagedserve.ToolChoiceNone())
	case choice == "auto":
		pagedserve.WithToolChoice(req, pagedserve.ToolChoiceAuto())
	case choice == "required":
		pagedserve.WithToolChoice(req, pagedserve.ToolChoiceRequired())
	case strings.HasPrefix(choice, "function:"):
		pagedserve.WithToolChoice(req, pagedserve.ToolChoiceFunction(strings.TrimPrefix(choice, "function:")))
	default:
		return fmt.Errorf("--tool-choice must be none, auto, required or function:NAME, got %q", choice)
	}
	if noParallel {
		pagedserve.WithParallelToolCalls(req, false)
	}
	return nil
}

// toolLine is the JSON line printed for each completion of a request with tool flags.
type toolLine struct {
	Index        uint32     `json:"index"`
	FinishReason string     `json:"finish_reason"`
	Content      string     `json:"content"`
	ToolCalls    []toolCall `json:"tool_calls"`
}

type toolCall struct {
	ID        string `json:"id"`
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
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
	jsonSchema := flag.String("json-schema", "", "constrain the output to JSON valid under this JSON Schema (its text, or @FILE)")
	jsonObject := flag.Bool("json-object", false, "constrain the output to any JSON object")
	regex := flag.String("regex", "", "constrain the output to match this regular expression")
	var choices repeated
	flag.Var(&choices, "choice", "constrain the output to exactly one of the --choice values (repeatable)")
	grammar := flag.String("grammar", "", "constrain the output to this EBNF grammar (GBNF dialect, a root rule; its text, or @FILE)")
	var tools repeated
	flag.Var(&tools, "tool", `a function the model may call (needs --chat; repeatable): OpenAI's JSON `+
		`{"name", "description", "parameters"}, or @FILE`)
	toolChoice := flag.String("tool-choice", "", "none, auto, required or function:NAME (needs --chat; default: auto with tools)")
	noParallel := flag.Bool("no-parallel-tool-calls", false, "at most one tool call per completion (needs --chat)")
	minTokens := flag.Uint("min-tokens", 0, "generate at least this many tokens before EOS or a stop id may end it")
	truncate := flag.Uint("truncate-prompt-tokens", 0, "keep only the prompt's last N tokens (0: all)")
	embed := flag.Bool("embed", false, "print the prompt's embedding (the Embed RPC) as a JSON array instead of generating")
	pooling := flag.String("pooling", "", "with --embed: last (default), mean or cls")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: %s [flags] PROMPT (- reads it from stdin)\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		return 2
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	set["json-object"] = *jsonObject // --json-object=false: not given
	set["no-parallel-tool-calls"] = *noParallel
	var toolFlags []string
	for _, name := range []string{"tool", "tool-choice", "no-parallel-tool-calls"} {
		if set[name] {
			toolFlags = append(toolFlags, "--"+name)
		}
	}
	if len(toolFlags) > 0 && !*chat {
		verb := "needs"
		if len(toolFlags) > 1 {
			verb = "need"
		}
		fmt.Fprintf(os.Stderr, "error: %s %s --chat (tools go with a chat prompt)\n", strings.Join(toolFlags, " and "), verb)
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

	params := pagedserve.Sampled(uint32(*maxTokens), float32(*temperature))
	if set["min-tokens"] {
		pagedserve.WithMinTokens(params, uint32(*minTokens))
	}
	if set["truncate-prompt-tokens"] {
		pagedserve.WithTruncatePromptTokens(params, uint32(*truncate))
	}
	if err := constrain(params, set, *jsonSchema, *regex, *grammar, choices); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		return 2
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

	if *embed {
		return printEmbedding(ctx, client, prompt, *model, *pooling)
	}
	req := pagedserve.TextRequest(prompt, params)
	if *chat {
		req = pagedserve.ChatRequest([]*pb.ChatMessage{pagedserve.User(prompt)}, params)
		if err := toolsFor(req, tools, *toolChoice, *noParallel); err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			return 2
		}
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
	if len(toolFlags) > 0 {
		out := json.NewEncoder(os.Stdout)
		out.SetEscapeHTML(false)
		for _, c := range completions {
			line := toolLine{Index: c.Index, FinishReason: c.FinishReasonName(), Content: c.Content, ToolCalls: []toolCall{}}
			for _, call := range c.ToolCalls {
				line.ToolCalls = append(line.ToolCalls, toolCall{ID: call.Id, Name: call.Name, Arguments: call.Arguments})
			}
			if err := out.Encode(line); err != nil {
				fmt.Fprintln(os.Stderr, "error:", err)
				return 1
			}
		}
	}
	for _, c := range completions {
		fmt.Fprintf(os.Stderr, "[%s; %d prompt (%d cached) + %d generated tokens; ttft %.0f ms, total %.2f s]\n",
			c.FinishReasonName(), c.Usage.GetPromptTokens(), c.Usage.GetCachedTokens(),
			c.Usage.GetCompletionTokens(), c.Timings.GetTimeToFirstTokenSeconds()*1000, c.Timings.GetE2ESeconds())
	}
	return 0
}

// printEmbedding prints the prompt's embedding as one JSON array line (--embed).
func printEmbedding(ctx context.Context, client *pagedserve.Client, prompt, model, pooling string) int {
	req, err := pagedserve.EmbedRequest(pooling, true, pagedserve.TextInput(prompt))
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		return 2
	}
	req.Model = model
	vectors, tokens, err := client.Embed(ctx, req)
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", pagedserve.Describe(err))
		return 1
	}
	if err := json.NewEncoder(os.Stdout).Encode(vectors[0]); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "[%d prompt tokens, %d dimensions]\n", tokens, len(vectors[0]))
	return 0
}
