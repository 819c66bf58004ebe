package io.pagedserve.examples;

import io.grpc.Context;
import io.grpc.StatusRuntimeException;
import io.pagedserve.client.Completion;
import io.pagedserve.client.PagedServeClient;
import io.pagedserve.v1.EmbedRequest;
import io.pagedserve.v1.GenerateRequest;
import io.pagedserve.v1.SamplingParams;
import io.pagedserve.v1.ToolCall;
import java.io.File;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Set;
import java.util.concurrent.CancellationException;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * Streams one generation from a pagedserve server and prints the text as it arrives; Ctrl-C
 * cancels the request (the server frees its KV blocks). The flags are the Go example's:
 *
 * <pre>
 * java -cp ... io.pagedserve.examples.Generate --address 127.0.0.1:50051 --max-tokens 64 "The capital of France is"
 * java -cp ... io.pagedserve.examples.Generate --chat --async "What is the capital of France?"
 * java -cp ... io.pagedserve.examples.Generate --chat --json-schema @person.schema.json "A person as JSON"
 * java -cp ... io.pagedserve.examples.Generate --choice yes --choice no "Is the sky blue? Answer:"
 * java -cp ... io.pagedserve.examples.Generate --chat --tool @get_weather.json --tool-choice required "Weather in Paris?"
 * </pre>
 *
 * <p>Structured outputs: at most one of {@code --json-schema SCHEMA}, {@code --json-object},
 * {@code --regex RE}, {@code --choice C} (repeatable) and {@code --grammar GBNF}; {@code @FILE}
 * reads a schema or grammar from a file.
 *
 * <p>Tool calling (with {@code --chat}): {@code --tool FUNCTION} is OpenAI's function object
 * {@code {"name", "description", "parameters"}} (or {@code {"type": "function", "function":
 * {...}}}), its JSON text or {@code @FILE}, repeatable; {@code --tool-choice} none, auto, required
 * or function:NAME; {@code --no-parallel-tool-calls} allows one call per completion. After the
 * text, one JSON line per completion: {@code {"index", "finish_reason", "content", "tool_calls":
 * [{"id", "name", "arguments"}]}} (arguments as JSON text), as the Go example prints it.
 *
 * <p>{@code --async} streams through the async stub (a StreamObserver) instead of iterating the
 * blocking stub. Exit status: 0 done, 1 the server (or the deadline) ended the call ("error:
 * CODE: message" on stderr), 2 bad flags, 130 cancelled by Ctrl-C.
 */
public final class Generate {
  private static final String USAGE =
      "usage: Generate [--address HOST:PORT] [--model NAME] [--max-tokens N] [--temperature T] [--chat]\n"
          + "                [--async] [--timeout SECONDS] [--api-key KEY] [--tls] [--tls-ca-file PEM]\n"
          + "                [--json-schema SCHEMA | --json-object | --regex RE | --choice C... | --grammar GBNF]\n"
          + "                [--tool FUNCTION... [--tool-choice none|auto|required|function:NAME]\n"
          + "                 [--no-parallel-tool-calls]] [--min-tokens N] [--truncate-prompt-tokens N]\n"
          + "                [--embed [--pooling last|mean|cls]] PROMPT\n"
          + "  (PROMPT - reads it from stdin; --model: one of the server's --served-model-name names,\n"
          + "   default the served model; --api-key defaults to $PAGEDSERVE_API_KEY; at most one\n"
          + "   constraint, --choice repeatable, @FILE reads a schema or grammar from FILE; --tool:\n"
          + "   OpenAI's function JSON or @FILE, repeatable; the tool flags need --chat)";

  public static void main(String[] args) throws Exception {
    // UTF-8 whatever the locale, and unbuffered so that each chunk shows as it arrives.
    PrintStream out = new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);
    String address = "127.0.0.1:50051";
    String model = "";
    int maxTokens = 128;
    float temperature = 0f;
    boolean chat = false;
    boolean async = false;
    double timeout = 0;
    String apiKey = System.getenv("PAGEDSERVE_API_KEY");
    boolean tls = false;
    String caFile = null;
    Set<String> constraints = new LinkedHashSet<>(); // the constraint flags given, in order
    String jsonSchema = null;
    String regex = null;
    String grammar = null;
    List<String> choices = new ArrayList<>();
    Set<String> toolFlags = new LinkedHashSet<>(); // the tool flags given
    List<String> tools = new ArrayList<>();
    String toolChoice = null;
    boolean noParallelToolCalls = false;
    Integer minTokens = null;
    Integer truncatePromptTokens = null;
    boolean embed = false;
    String pooling = null;
    List<String> positional = new ArrayList<>();
    try {
      for (int i = 0; i < args.length; i++) {
        String arg = args[i];
        String value = null;
        if (arg.startsWith("--") && arg.contains("=")) {
          value = arg.substring(arg.indexOf('=') + 1);
          arg = arg.substring(0, arg.indexOf('='));
        }
        switch (arg) {
          case "--chat":
            chat = true;
            continue;
          case "--async":
            async = true;
            continue;
          case "--tls":
            tls = true;
            continue;
          case "--json-object":
            constraints.add(arg);
            continue;
          case "--no-parallel-tool-calls":
            noParallelToolCalls = true;
            continue;
          case "--embed":
            embed = true;
            continue;
          case "-h":
          case "--help":
            System.err.println(USAGE);
            System.exit(0);
            break;
          default:
            break;
        }
        if (arg.startsWith("--")) {
          if (value == null) {
            if (i + 1 >= args.length) {
              throw new IllegalArgumentException(arg + " needs a value");
            }
            value = args[++i];
          }
          switch (arg) {
            case "--address":
              address = value;
              break;
            case "--model":
              model = value;
              break;
            case "--max-tokens":
              maxTokens = Integer.parseInt(value);
              break;
            case "--temperature":
              temperature = Float.parseFloat(value);
              break;
            case "--timeout":
              timeout = Double.parseDouble(value);
              break;
            case "--api-key":
              apiKey = value;
              break;
            case "--tls-ca-file":
              caFile = value;
              break;
            case "--json-schema":
              jsonSchema = value;
              constraints.add(arg);
              break;
            case "--regex":
              regex = value;
              constraints.add(arg);
              break;
            case "--choice":
              choices.add(value);
              constraints.add(arg);
              break;
            case "--grammar":
              grammar = value;
              constraints.add(arg);
              break;
            case "--tool":
              tools.add(value);
              break;
            case "--tool-choice":
              toolChoice = value;
              break;
            case "--min-tokens":
              minTokens = Integer.parseUnsignedInt(value);
              break;
            case "--truncate-prompt-tokens":
              truncatePromptTokens = Integer.parseUnsignedInt(value);
              break;
            case "--pooling":
              pooling = value;
              break;
            default:
              throw new IllegalArgumentException("unknown flag " + arg);
          }
        } else {
          positional.add(arg);
        }
      }
      if (positional.size() != 1) {
        throw new IllegalArgumentException("one PROMPT expected");
      }
      if (constraints.size() > 1) {
        throw new IllegalArgumentException("at most one constraint flag, got " + String.join(" and ", constraints));
      }
      // named in the Go example's order, whatever the order given
      if (!tools.isEmpty()) {
        toolFlags.add("--tool");
      }
      if (toolChoice != null) {
        toolFlags.add("--tool-choice");
      }
      if (noParallelToolCalls) {
        toolFlags.add("--no-parallel-tool-calls");
      }
      if (!toolFlags.isEmpty() && !chat) {
        throw new IllegalArgumentException(
            String.join(" and ", toolFlags)
                + (toolFlags.size() > 1 ? " need" : " needs")
                + " --chat (tools go with a chat prompt)");
      }
    } catch (IllegalArgumentException e) {
      System.err.println("error: " + e.getMessage() + "\n" + USAGE);
      System.exit(2);
    }
    String prompt = positional.get(0);
    if (prompt.equals("-")) {
      prompt = new String(System.in.readAllBytes(), StandardCharsets.UTF_8);
    }

    PagedServeClient.Builder builder = PagedServeClient.forAddress(address);
    if (apiKey != null && !apiKey.isEmpty()) {
      builder.apiKey(apiKey);
    }
    if (caFile != null) {
      builder.caFile(new File(caFile));
    } else if (tls) {
      builder.tls();
    }
    if (timeout > 0) {
      builder.timeout(Duration.ofNanos((long) (timeout * 1e9)));
    }
    if (embed) {
      System.exit(printEmbedding(builder, prompt, model, pooling, out));
    }
    SamplingParams params = PagedServeClient.sampled(maxTokens, temperature);
    if (minTokens != null) {
      params = PagedServeClient.withMinTokens(params, minTokens);
    }
    if (truncatePromptTokens != null) {
      params = PagedServeClient.withTruncatePromptTokens(params, truncatePromptTokens);
    }
    try {
      if (jsonSchema != null) {
        params = PagedServeClient.withJsonSchema(params, textOrFile(jsonSchema));
      } else if (constraints.contains("--json-object")) {
        params = PagedServeClient.withJsonObject(params);
      } else if (regex != null) {
        params = PagedServeClient.withRegex(params, regex);
      } else if (!choices.isEmpty()) {
        params = PagedServeClient.withChoice(params, choices);
      } else if (grammar != null) {
        params = PagedServeClient.withGrammar(params, textOrFile(grammar));
      }
    } catch (IOException e) {
      System.err.println("error: " + e);
      System.exit(2);
    }
    GenerateRequest request =
        chat
            ? PagedServeClient.chatRequest(Collections.singletonList(PagedServeClient.user(prompt)), params)
            : PagedServeClient.textRequest(prompt, params);
    if (chat) {
      try {
        request = withToolFlags(request, tools, toolChoice, noParallelToolCalls);
      } catch (IllegalArgumentException | IOException e) {
        System.err.println("error: " + e.getMessage());
        System.exit(2);
      }
    }
    request = request.toBuilder().setModel(model).build(); // "": unset, the server's served model
    boolean printTools = !toolFlags.isEmpty();
    int status;
    try (PagedServeClient client = builder.build()) {
      status = async ? runAsync(client, request, out, printTools) : runBlocking(client, request, out, printTools);
    } catch (IOException | RuntimeException e) { // e.g. an unreadable CA file, no TLS provider
      System.err.println("error: " + e);
      status = 1;
    }
    System.exit(status);
  }

  /** --embed: the prompt's embedding (the Embed RPC) as one JSON array line; the exit status. */
  private static int printEmbedding(
      PagedServeClient.Builder builder, String prompt, String model, String pooling, PrintStream out) {
    EmbedRequest request;
    try {
      request = PagedServeClient.embedRequest(pooling, true, Collections.singletonList(prompt));
    } catch (IllegalArgumentException e) {
      System.err.println("error: " + e.getMessage());
      return 2;
    }
    try (PagedServeClient client = builder.build()) {
      List<Float> vector = client.embed(request.toBuilder().setModel(model).build()).get(0);
      StringBuilder line = new StringBuilder("[");
      for (int i = 0; i < vector.size(); i++) {
        line.append(i == 0 ? "" : ",").append(vector.get(i));
      }
      out.println(line.append("]"));
      System.err.println("[" + vector.size() + " dimensions]");
      return 0;
    } catch (StatusRuntimeException e) {
      System.err.println("error: " + PagedServeClient.describe(e));
      return 1;
    } catch (IOException | RuntimeException e) {
      System.err.println("error: " + e);
      return 1;
    }
  }

  /** A flag's text, or the contents of FILE for "@FILE". */
  private static String textOrFile(String value) throws IOException {
    return value.startsWith("@") ? Files.readString(Path.of(value.substring(1)), StandardCharsets.UTF_8) : value;
  }

  /** The chat request with the tools, tool choice and parallel flag of the tool flags. */
  private static GenerateRequest withToolFlags(
      GenerateRequest request, List<String> tools, String toolChoice, boolean noParallel) throws IOException {
    for (String value : tools) {
      String text;
      try {
        text = textOrFile(value);
      } catch (IOException e) {
        throw new IOException("--tool: " + e, e);
      }
      try {
        request = PagedServeClient.withTools(request, PagedServeClient.toolFromJson(text));
      } catch (IllegalArgumentException e) {
        throw new IllegalArgumentException("--tool " + value + ": " + e.getMessage(), e);
      }
    }
    if (toolChoice != null) {
      if (toolChoice.equals("none")) {
        request = PagedServeClient.withToolChoice(request, PagedServeClient.toolChoiceNone());
      } else if (toolChoice.equals("auto")) {
        request = PagedServeClient.withToolChoice(request, PagedServeClient.toolChoiceAuto());
      } else if (toolChoice.equals("required")) {
        request = PagedServeClient.withToolChoice(request, PagedServeClient.toolChoiceRequired());
      } else if (toolChoice.startsWith("function:")) {
        String name = toolChoice.substring("function:".length());
        request = PagedServeClient.withToolChoice(request, PagedServeClient.toolChoiceFunction(name));
      } else {
        throw new IllegalArgumentException(
            "--tool-choice must be none, auto, required or function:NAME, got \"" + toolChoice + "\"");
      }
    }
    if (noParallel) {
      request = PagedServeClient.withParallelToolCalls(request, false);
    }
    return request;
  }

  /** Iterates the blocking stub inside a cancellable context that Ctrl-C cancels. */
  static int runBlocking(PagedServeClient client, GenerateRequest request, PrintStream out, boolean printTools) {
    Context.CancellableContext context = Context.current().withCancellation();
    AtomicBoolean interrupted = new AtomicBoolean();
    CountDownLatch finished = new CountDownLatch(1);
    Thread hook =
        new Thread(
            () -> {
              interrupted.set(true);
              context.cancel(null);
              awaitQuietly(finished);
            });
    Runtime.getRuntime().addShutdownHook(hook);
    try {
      List<Completion> completions = context.call(() -> client.stream(request, chunk -> out.print(chunk.getText())));
      return finish(completions, out, printTools);
    } catch (StatusRuntimeException e) {
      return failed(e, interrupted.get(), finished);
    } catch (Exception e) {
      throw new IllegalStateException(e);
    } finally {
      if (!interrupted.get()) {
        Runtime.getRuntime().removeShutdownHook(hook);
      }
      finished.countDown();
    }
  }

  /** Streams through the async stub (a StreamObserver); Ctrl-C cancels the future. */
  static int runAsync(PagedServeClient client, GenerateRequest request, PrintStream out, boolean printTools)
      throws InterruptedException {
    CompletableFuture<List<Completion>> future = client.streamAsync(request, chunk -> out.print(chunk.getText()));
    AtomicBoolean interrupted = new AtomicBoolean();
    CountDownLatch finished = new CountDownLatch(1);
    Thread hook =
        new Thread(
            () -> {
              interrupted.set(true);
              future.cancel(true);
              awaitQuietly(finished);
            });
    Runtime.getRuntime().addShutdownHook(hook);
    try {
      return finish(future.get(), out, printTools);
    } catch (CancellationException e) {
      return failed(null, true, finished);
    } catch (ExecutionException e) {
      return failed((StatusRuntimeException) e.getCause(), interrupted.get(), finished);
    } finally {
      if (!interrupted.get()) {
        Runtime.getRuntime().removeShutdownHook(hook);
      }
      finished.countDown();
    }
  }

  private static int finish(List<Completion> completions, PrintStream out, boolean printTools) {
    out.println();
    if (printTools) {
      for (Completion c : completions) {
        out.println(toolLine(c));
      }
    }
    for (Completion c : completions) {
      System.err.printf(
          "[%s; %d prompt (%d cached) + %d generated tokens; ttft %.0f ms, total %.2f s]%n",
          c.finishReasonName(),
          c.usage.getPromptTokens(),
          c.usage.getCachedTokens(),
          c.usage.getCompletionTokens(),
          c.timings.getTimeToFirstTokenSeconds() * 1000,
          c.timings.getE2ESeconds());
    }
    return 0;
  }

  /** {"index", "finish_reason", "content", "tool_calls": [{"id", "name", "arguments"}]}, as Go prints it. */
  private static String toolLine(Completion c) {
    StringBuilder b = new StringBuilder();
    b.append("{\"index\":").append(c.index);
    b.append(",\"finish_reason\":").append(quote(c.finishReasonName()));
    b.append(",\"content\":").append(quote(c.content));
    b.append(",\"tool_calls\":[");
    for (int i = 0; i < c.toolCalls.size(); i++) {
      ToolCall call = c.toolCalls.get(i);
      b.append(i == 0 ? "" : ",");
      b.append("{\"id\":").append(quote(call.getId()));
      b.append(",\"name\":").append(quote(call.getName()));
      b.append(",\"arguments\":").append(quote(call.getArguments())).append('}');
    }
    return b.append("]}").toString();
  }

  /** A JSON string literal, escaped as Go's encoding/json does (HTML escaping off). */
  private static String quote(String s) {
    StringBuilder b = new StringBuilder(s.length() + 2).append('"');
    for (char ch : s.toCharArray()) {
      switch (ch) {
        case '"':
          b.append("\\\"");
          break;
        case '\\':
          b.append("\\\\");
          break;
        case '\n':
          b.append("\\n");
          break;
        case '\r':
          b.append("\\r");
          break;
        case '\t':
          b.append("\\t");
          break;
        default:
          if (ch < 0x20 || ch == 0x2028 || ch == 0x2029) {
            b.append(String.format("\\u%04x", (int) ch));
          } else {
            b.append(ch);
          }
      }
    }
    return b.append('"').toString();
  }

  private static int failed(StatusRuntimeException e, boolean interrupted, CountDownLatch finished) {
    if (interrupted) {
      System.err.println("\ncancelled");
      finished.countDown();
      return 130;
    }
    System.err.println("\nerror: " + PagedServeClient.describe(e));
    return 1;
  }

  private static void awaitQuietly(CountDownLatch latch) {
    try {
      latch.await(5, TimeUnit.SECONDS);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
  }
}
