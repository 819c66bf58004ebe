package io.pagedserve.client;

import io.grpc.Context;
import io.grpc.Deadline;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.netty.GrpcSslContexts;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import io.grpc.stub.MetadataUtils;
import io.netty.handler.ssl.SslContextBuilder;
import io.pagedserve.v1.ChatMessage;
import io.pagedserve.v1.ChatMessages;
import io.pagedserve.v1.Choices;
import io.pagedserve.v1.DetokenizeRequest;
import io.pagedserve.v1.EmbedInput;
import io.pagedserve.v1.EmbedRequest;
import io.pagedserve.v1.EmbedResponse;
import io.pagedserve.v1.Embedding;
import io.pagedserve.v1.GenerateComplete;
import io.pagedserve.v1.GenerateRequest;
import io.pagedserve.v1.GenerateResponse;
import io.pagedserve.v1.GenerationServiceGrpc;
import io.pagedserve.v1.ListModelsRequest;
import io.pagedserve.v1.ModelCard;
import io.pagedserve.v1.PoolingParams;
import io.pagedserve.v1.SamplingParams;
import io.pagedserve.v1.TokenChunk;
import io.pagedserve.v1.TokenIds;
import io.pagedserve.v1.TokenizeRequest;
import io.pagedserve.v1.Tool;
import io.pagedserve.v1.ToolCall;
import io.pagedserve.v1.ToolChoice;
import java.io.File;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.OptionalLong;
import java.util.TreeMap;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import java.util.function.Consumer;
import java.util.function.Supplier;
import javax.net.ssl.SSLException;

/**
 * A small typed client for pagedserve's GenerationService: streaming generation (blocking
 * iteration or an async StreamObserver), tokenize, detokenize and list models, with a deadline,
 * an API key and TLS.
 *
 * <pre>{@code
 * try (PagedServeClient client = PagedServeClient.forAddress("127.0.0.1:50051")
 *     .timeout(Duration.ofMinutes(1)).build()) {
 *   GenerateRequest request = PagedServeClient.textRequest("The capital of France is", PagedServeClient.greedy(32));
 *   List<Completion> out = client.stream(request, chunk -> System.out.print(chunk.getText()));
 * }
 * }</pre>
 *
 * <p>Structured outputs: {@link #withJsonSchema}, {@link #withJsonObject}, {@link #withRegex},
 * {@link #withChoice} and {@link #withGrammar} constrain the output of a request's sampling
 * parameters, e.g. {@code withChoice(greedy(4), "yes", "no")}.
 *
 * <p>Tool calling (chat requests): {@link #withTools}, {@link #withToolChoice} and
 * {@link #withParallelToolCalls} set a chat request's tools ({@link #tool},
 * {@link #toolFromJson}) and how the model may call them ({@link #toolChoiceRequired}, ...); each
 * Completion then has {@code toolCalls} and {@code content}, and finishes with "tool_calls" when
 * it made a call.
 *
 * <p>Errors are {@link StatusRuntimeException}s carrying the server's status code and message
 * (which names the offending field for INVALID_ARGUMENT). Calls retry as {@link RetryPolicy}
 * says: UNAVAILABLE only before the first response, RESOURCE_EXHAUSTED after the server's
 * retry-after.
 */
public final class PagedServeClient implements AutoCloseable {
  static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);

  /** Options of a client; {@link #build()} connects (lazily, on the first call). */
  public static final class Builder {
    private final String target;
    private String apiKey;
    private boolean tls;
    private File caFile;
    private Duration timeout;
    private RetryPolicy retryPolicy = RetryPolicy.DEFAULT;

    private Builder(String target) {
      this.target = target;
    }

    /** Sent as {@code authorization: Bearer <key>} metadata on every call. */
    public Builder apiKey(String apiKey) {
      this.apiKey = apiKey;
      return this;
    }

    /** Connect over TLS, verifying the server against the JVM's default roots. */
    public Builder tls() {
      this.tls = true;
      return this;
    }

    /** Connect over TLS, verifying the server against this PEM CA. */
    public Builder caFile(File caFile) {
      this.caFile = caFile;
      this.tls = true;
      return this;
    }

    /** The deadline of every call (retries happen inside it); null for none. */
    public Builder timeout(Duration timeout) {
      this.timeout = timeout;
      return this;
    }

    /** The retry policy; {@link RetryPolicy#NONE} disables retries. */
    public Builder retryPolicy(RetryPolicy retryPolicy) {
      this.retryPolicy = retryPolicy;
      return this;
    }

    public PagedServeClient build() throws SSLException {
      NettyChannelBuilder channel = NettyChannelBuilder.forTarget(target).userAgent("pagedserve-java");
      if (tls) {
        SslContextBuilder ssl = GrpcSslContexts.forClient();
        if (caFile != null) {
          ssl.trustManager(caFile);
        }
        channel.sslContext(ssl.build()).useTransportSecurity();
      } else {
        channel.usePlaintext();
      }
      return new PagedServeClient(channel.build(), this);
    }
  }

  public static Builder forAddress(String target) {
    return new Builder(target);
  }

  private final ManagedChannel channel;
  private final GenerationServiceGrpc.GenerationServiceBlockingStub blocking;
  private final GenerationServiceGrpc.GenerationServiceStub async;
  private final Duration timeout;
  private final RetryPolicy retry;
  private final ScheduledExecutorService timer;

  private PagedServeClient(ManagedChannel channel, Builder options) {
    this.channel = channel;
    GenerationServiceGrpc.GenerationServiceBlockingStub b = GenerationServiceGrpc.newBlockingStub(channel);
    GenerationServiceGrpc.GenerationServiceStub a = GenerationServiceGrpc.newStub(channel);
    if (options.apiKey != null && !options.apiKey.isEmpty()) {
      Metadata headers = new Metadata();
      headers.put(AUTHORIZATION, "Bearer " + options.apiKey);
      b = b.withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers));
      a = a.withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers));
    }
    this.blocking = b;
    this.async = a;
    this.timeout = options.timeout;
    this.retry = options.retryPolicy;
    this.timer =
        Executors.newSingleThreadScheduledExecutor(
            r -> {
              Thread t = new Thread(r, "pagedserve-retry");
              t.setDaemon(true);
              return t;
            });
  }

  // -- requests ------------------------------------------------------------------------------

  /** Greedy decoding of at most {@code maxTokens} tokens. */
  public static SamplingParams greedy(int maxTokens) {
    return sampled(maxTokens, 0f);
  }

  /** Sampling at {@code temperature}, at most {@code maxTokens} tokens. */
  public static SamplingParams sampled(int maxTokens, float temperature) {
    return SamplingParams.newBuilder().setMaxTokens(maxTokens).setTemperature(temperature).build();
  }

  /** EOS and the stop token ids are masked until {@code n} tokens were generated (vLLM's min_tokens). */
  public static SamplingParams withMinTokens(SamplingParams params, int n) {
    return params.toBuilder().setMinTokens(n).build();
  }

  /** Each prompt token's logprob and the {@code k} most likely tokens at its position. */
  public static SamplingParams withPromptLogprobs(SamplingParams params, int k) {
    return params.toBuilder().setPromptLogprobs(k).build();
  }

  /** Only the prompt's last {@code n} tokens are kept (vLLM's truncate_prompt_tokens). */
  public static SamplingParams withTruncatePromptTokens(SamplingParams params, int n) {
    return params.toBuilder().setTruncatePromptTokens(n).build();
  }

  // -- structured outputs: each sets the constraint oneof (replacing any set before: a request has
  // at most one) on a copy of params. The server checks the values (sizes, a compilable schema
  // or grammar) and refuses a bad one with INVALID_ARGUMENT naming the field
  // ("sampling_params.json_schema could not be compiled: ...").
  //
  //   SamplingParams params = PagedServeClient.withJsonSchema(PagedServeClient.greedy(64),
  //       "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"}},\"required\":[\"name\"]}");
  //   SamplingParams yesNo = PagedServeClient.withChoice(PagedServeClient.greedy(4), "yes", "no");

  /** The output is a JSON value valid under {@code schema} (a JSON Schema document, as JSON text). */
  public static SamplingParams withJsonSchema(SamplingParams params, String schema) {
    return params.toBuilder().setJsonSchema(schema).build();
  }

  /** The output is any JSON object (OpenAI's response_format json_object). */
  public static SamplingParams withJsonObject(SamplingParams params) {
    return params.toBuilder().setJsonObject(true).build();
  }

  /** The whole output matches the regular expression {@code pattern}. */
  public static SamplingParams withRegex(SamplingParams params, String pattern) {
    return params.toBuilder().setRegex(pattern).build();
  }

  /** The output is exactly one of {@code choices} (1 to 256 non-empty strings). */
  public static SamplingParams withChoice(SamplingParams params, List<String> choices) {
    return params.toBuilder().setChoice(Choices.newBuilder().addAllChoices(choices)).build();
  }

  /** The output is exactly one of {@code choices} (1 to 256 non-empty strings). */
  public static SamplingParams withChoice(SamplingParams params, String... choices) {
    return withChoice(params, Arrays.asList(choices));
  }

  /** The output is a sentence of an EBNF grammar (GBNF dialect, with a {@code root} rule). */
  public static SamplingParams withGrammar(SamplingParams params, String grammar) {
    return params.toBuilder().setGrammar(grammar).build();
  }

  /** A plain-text prompt (no chat template). */
  public static GenerateRequest textRequest(String prompt, SamplingParams params) {
    return GenerateRequest.newBuilder().setText(prompt).setSamplingParams(params).build();
  }

  /** A chat conversation (the model's chat template applied). */
  public static GenerateRequest chatRequest(List<ChatMessage> messages, SamplingParams params) {
    ChatMessages chat = ChatMessages.newBuilder().addAllMessages(messages).build();
    return GenerateRequest.newBuilder().setChat(chat).setSamplingParams(params).build();
  }

  /** A chat message with role "user". */
  public static ChatMessage user(String content) {
    return ChatMessage.newBuilder().setRole("user").setContent(content).build();
  }

  /**
   * A chat message with role "assistant": an earlier answer, its text and the tool calls it made
   * (a Completion's {@code toolCalls}, sent back as they came).
   */
  public static ChatMessage assistant(String content, List<ToolCall> toolCalls) {
    return ChatMessage.newBuilder().setRole("assistant").setContent(content).addAllToolCalls(toolCalls).build();
  }

  /** A chat message with role "assistant" and its tool calls. */
  public static ChatMessage assistant(String content, ToolCall... toolCalls) {
    return assistant(content, Arrays.asList(toolCalls));
  }

  /** A chat message with role "tool": the result of the call whose id is {@code callId}. */
  public static ChatMessage toolResult(String callId, String content) {
    return ChatMessage.newBuilder().setRole("tool").setToolCallId(callId).setContent(content).build();
  }

  // -- tool calling (chat requests only; docs/tool_calling.md): withTools, withToolChoice and
  // withParallelToolCalls return a copy of a chat request with ChatMessages' fields set (an
  // IllegalArgumentException for a request without a chat prompt). The server checks the tools
  // (names, sizes, compilable schemas) and refuses bad ones with INVALID_ARGUMENT naming the
  // field ("prompt.chat.tools[0].name ...").
  //
  //   Tool weather = PagedServeClient.tool("get_weather", "The weather of a city.",
  //       "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}");
  //   GenerateRequest request = PagedServeClient.withToolChoice(
  //       PagedServeClient.withTools(PagedServeClient.chatRequest(messages, greedy(64)), weather),
  //       PagedServeClient.toolChoiceRequired());

  /**
   * A function the model may call: {@code name} (1 to 64 of a-z A-Z 0-9 _ -), what it does, and
   * its arguments' JSON Schema as JSON text ("" or null: any JSON object).
   */
  public static Tool tool(String name, String description, String parametersJson) {
    return Tool.newBuilder()
        .setName(name)
        .setDescription(description == null ? "" : description)
        .setParameters(parametersJson == null ? "" : parametersJson)
        .build();
  }

  /**
   * A tool given as OpenAI's JSON: a function object {@code {"name", "description", "parameters"}}
   * or the whole tool {@code {"type": "function", "function": {...}}}. The parameters schema is
   * kept as written (its properties' order is the order they are generated in).
   *
   * @throws IllegalArgumentException when it is not JSON or has no name
   */
  public static Tool toolFromJson(String json) {
    Map<String, String> members = Json.members(json);
    Map<String, String> function = members.containsKey("function") ? Json.members(members.get("function")) : members;
    if (!function.containsKey("name")) {
      throw new IllegalArgumentException(
          "tool: needs a \"name\" (OpenAI's {\"type\": \"function\", \"function\": {...}})");
    }
    String description = function.getOrDefault("description", "null");
    String parameters = function.getOrDefault("parameters", "null");
    return tool(
        member(function, "name"),
        description.equals("null") ? "" : member(function, "description"),
        parameters.equals("null") ? "" : parameters);
  }

  private static String member(Map<String, String> object, String name) {
    try {
      return Json.string(object.get(name));
    } catch (IllegalArgumentException e) {
      throw new IllegalArgumentException("tool: \"" + name + "\" must be a string, got " + object.get(name), e);
    }
  }

  /** No calls: the tools are not shown to the model. */
  public static ToolChoice toolChoiceNone() {
    return ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_NONE).build();
  }

  /** The model decides (the default with tools); its calls are parsed from its own format. */
  public static ToolChoice toolChoiceAuto() {
    return ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_AUTO).build();
  }

  /** At least one call (exactly one without parallel tool calls), forced by a grammar. */
  public static ToolChoice toolChoiceRequired() {
    return ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_REQUIRED).build();
  }

  /** One call of the function {@code name} (one of the request's tools), forced by a grammar. */
  public static ToolChoice toolChoiceFunction(String name) {
    return ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_FUNCTION).setFunctionName(name).build();
  }

  private static GenerateRequest withChat(
      GenerateRequest request, String helper, Consumer<ChatMessages.Builder> change) {
    if (!request.hasChat()) {
      throw new IllegalArgumentException(helper + " needs a chat request (chatRequest)");
    }
    ChatMessages.Builder chat = request.getChat().toBuilder();
    change.accept(chat);
    return request.toBuilder().setChat(chat).build();
  }

  /** The chat request with {@code tools} added to the functions the model may call (at most 128 in all). */
  public static GenerateRequest withTools(GenerateRequest request, List<Tool> tools) {
    return withChat(request, "withTools", chat -> chat.addAllTools(tools));
  }

  /** The chat request with {@code tools} added to the functions the model may call (at most 128 in all). */
  public static GenerateRequest withTools(GenerateRequest request, Tool... tools) {
    return withTools(request, Arrays.asList(tools));
  }

  /** The chat request with its tool choice set (whether and how the model may call the tools). */
  public static GenerateRequest withToolChoice(GenerateRequest request, ToolChoice choice) {
    return withChat(request, "withToolChoice", chat -> chat.setToolChoice(choice));
  }

  /** The chat request saying whether one completion may make several calls (the server's default: true). */
  public static GenerateRequest withParallelToolCalls(GenerateRequest request, boolean parallel) {
    return withChat(request, "withParallelToolCalls", chat -> chat.setParallelToolCalls(parallel));
  }

  /** "CODE: message", the form the Go and Python clients print. */
  public static String describe(StatusRuntimeException e) {
    Status s = e.getStatus();
    return s.getCode().name() + ": " + (s.getDescription() == null ? "" : s.getDescription());
  }

  // -- calls ---------------------------------------------------------------------------------

  private Deadline deadline() {
    return timeout == null ? null : Deadline.after(timeout.toNanos(), TimeUnit.NANOSECONDS);
  }

  private GenerationServiceGrpc.GenerationServiceBlockingStub blockingStub(Deadline deadline) {
    return deadline == null ? blocking : blocking.withDeadline(deadline);
  }

  /** The wait before the next attempt, or empty to give up (then the caller rethrows). */
  private OptionalLong nextDelay(int attempt, boolean started, Throwable error, Deadline deadline) {
    Status status = Status.fromThrowable(error);
    OptionalLong wait = retry.delayNanos(attempt, started, status, Status.trailersFromThrowable(error));
    if (wait.isPresent() && deadline != null && deadline.timeRemaining(TimeUnit.NANOSECONDS) <= wait.getAsLong()) {
      return OptionalLong.empty();
    }
    return wait;
  }

  private <T> T withRetries(Deadline deadline, Supplier<T> attempt) {
    for (int n = 1; ; n++) {
      try {
        return attempt.get();
      } catch (StatusRuntimeException e) {
        OptionalLong wait = nextDelay(n, false, e, deadline);
        if (!wait.isPresent()) {
          throw e;
        }
        sleep(wait.getAsLong(), e);
      }
    }
  }

  private static void sleep(long nanos, StatusRuntimeException cause) {
    try {
      TimeUnit.NANOSECONDS.sleep(nanos);
    } catch (InterruptedException ie) {
      Thread.currentThread().interrupt();
      throw Status.CANCELLED.withDescription("interrupted while waiting to retry").withCause(cause).asRuntimeException();
    }
  }

  /** Folds a stream into one Completion per index. */
  private static final class Collector {
    final Map<Integer, StringBuilder> text = new TreeMap<>();
    final Map<Integer, List<Integer>> tokens = new TreeMap<>();
    final Map<Integer, Completion> done = new TreeMap<>();

    void add(GenerateResponse response, Consumer<TokenChunk> onChunk) {
      if (response.hasChunk()) {
        TokenChunk chunk = response.getChunk();
        text.computeIfAbsent(chunk.getIndex(), i -> new StringBuilder()).append(chunk.getText());
        tokens.computeIfAbsent(chunk.getIndex(), i -> new ArrayList<>()).addAll(chunk.getTokenIdsList());
        if (onChunk != null) {
          onChunk.accept(chunk);
        }
      } else if (response.hasComplete()) {
        GenerateComplete end = response.getComplete();
        int i = end.getIndex();
        done.put(
            i,
            new Completion(
                response.getRequestId(),
                i,
                end.getFinishReason(),
                end.getStopString(),
                text.containsKey(i) ? text.get(i).toString() : "",
                tokens.containsKey(i) ? tokens.get(i) : new ArrayList<>(),
                end.getUsage(),
                end.getTimings(),
                end.getToolCallsList(),
                end.getContent()));
      }
    }

    List<Completion> result() {
      return new ArrayList<>(done.values());
    }
  }

  /**
   * Sends {@code request} and calls {@code onChunk} (may be null) with each chunk as it arrives,
   * iterating the blocking stub; returns one Completion per index, in index order. To cancel,
   * run it inside a {@link io.grpc.Context.CancellableContext} and cancel that: the server aborts
   * the request and frees its KV blocks, and this throws CANCELLED.
   */
  public List<Completion> stream(GenerateRequest request, Consumer<TokenChunk> onChunk) {
    Deadline deadline = deadline();
    for (int n = 1; ; n++) {
      Collector collector = new Collector();
      boolean started = false;
      // The call is bound to this context: cancelling it ends the call if we leave early (an
      // exception from onChunk), and a cancelled caller's context cancels it too.
      Context.CancellableContext attempt = Context.current().withCancellation();
      Context previous = attempt.attach();
      try {
        Iterator<GenerateResponse> responses = blockingStub(deadline).generate(request);
        while (responses.hasNext()) {
          GenerateResponse response = responses.next();
          started = true;
          collector.add(response, onChunk);
        }
        return collector.result();
      } catch (StatusRuntimeException e) {
        OptionalLong wait = nextDelay(n, started, e, deadline);
        if (!wait.isPresent()) {
          throw e;
        }
        sleep(wait.getAsLong(), e);
      } finally {
        attempt.detach(previous);
        attempt.cancel(null);
      }
    }
  }

  /** {@link #stream} without a chunk callback. */
  public List<Completion> generate(GenerateRequest request) {
    return stream(request, null);
  }

  /**
   * Sends {@code request} through the async stub (a StreamObserver): {@code onChunk} runs on a
   * gRPC thread for each chunk as it arrives. The future completes with one Completion per
   * index, or exceptionally with the StatusRuntimeException; cancelling the future cancels the
   * call (the server aborts the request and frees its KV blocks).
   */
  public CompletableFuture<List<Completion>> streamAsync(GenerateRequest request, Consumer<TokenChunk> onChunk) {
    AsyncCall call = new AsyncCall(request, onChunk, deadline());
    call.start(1);
    return call.future;
  }

  private final class AsyncCall {
    final GenerateRequest request;
    final Consumer<TokenChunk> onChunk;
    final Deadline deadline;
    final AtomicReference<ClientCallStreamObserver<GenerateRequest>> current = new AtomicReference<>();
    final AtomicReference<ScheduledFuture<?>> pendingRetry = new AtomicReference<>();
    final CompletableFuture<List<Completion>> future =
        new CompletableFuture<List<Completion>>() {
          @Override
          public boolean cancel(boolean mayInterruptIfRunning) {
            boolean cancelled = super.cancel(mayInterruptIfRunning);
            ClientCallStreamObserver<GenerateRequest> call = current.get();
            if (call != null) {
              call.cancel("cancelled by the client", null);
            }
            ScheduledFuture<?> retry = pendingRetry.get();
            if (retry != null) {
              retry.cancel(false);
            }
            return cancelled;
          }
        };

    AsyncCall(GenerateRequest request, Consumer<TokenChunk> onChunk, Deadline deadline) {
      this.request = request;
      this.onChunk = onChunk;
      this.deadline = deadline;
    }

    void start(int attempt) {
      if (future.isDone()) {
        return;
      }
      GenerationServiceGrpc.GenerationServiceStub stub = deadline == null ? async : async.withDeadline(deadline);
      stub.generate(
          request,
          new ClientResponseObserver<GenerateRequest, GenerateResponse>() {
            final Collector collector = new Collector();
            boolean started;

            @Override
            public void beforeStart(ClientCallStreamObserver<GenerateRequest> requestStream) {
              current.set(requestStream);
            }

            @Override
            public void onNext(GenerateResponse response) {
              started = true;
              try {
                collector.add(response, onChunk);
              } catch (RuntimeException e) {
                current.get().cancel("the chunk callback failed", e);
              }
            }

            @Override
            public void onError(Throwable t) {
              OptionalLong wait = future.isDone() ? OptionalLong.empty() : nextDelay(attempt, started, t, deadline);
              if (wait.isPresent()) {
                pendingRetry.set(timer.schedule(() -> start(attempt + 1), wait.getAsLong(), TimeUnit.NANOSECONDS));
              } else {
                future.completeExceptionally(
                    t instanceof StatusRuntimeException ? t : Status.fromThrowable(t).asRuntimeException());
              }
            }

            @Override
            public void onCompleted() {
              future.complete(collector.result());
            }
          });
    }
  }

  /** The token ids of a plain-text prompt. */
  public List<Integer> tokenize(String text) {
    Deadline deadline = deadline();
    TokenizeRequest request = TokenizeRequest.newBuilder().setText(text).build();
    return withRetries(deadline, () -> blockingStub(deadline).tokenize(request).getTokenIdsList());
  }

  /** The token ids of a chat prompt (chat template applied). */
  public List<Integer> tokenizeChat(List<ChatMessage> messages) {
    Deadline deadline = deadline();
    TokenizeRequest request =
        TokenizeRequest.newBuilder().setChat(ChatMessages.newBuilder().addAllMessages(messages)).build();
    return withRetries(deadline, () -> blockingStub(deadline).tokenize(request).getTokenIdsList());
  }

  /** The text of some token ids. */
  public String detokenize(List<Integer> tokenIds) {
    Deadline deadline = deadline();
    DetokenizeRequest request = DetokenizeRequest.newBuilder().addAllTokenIds(tokenIds).build();
    return withRetries(deadline, () -> blockingStub(deadline).detokenize(request).getText());
  }

  /**
   * One embedding per input of {@code request} (the Embed RPC), in input order: each input's
   * prompt computed, nothing generated, its final hidden states pooled (see {@link #embedRequest}).
   */
  public List<List<Float>> embed(EmbedRequest request) {
    Deadline deadline = deadline();
    EmbedResponse response = withRetries(deadline, () -> blockingStub(deadline).embed(request));
    List<List<Float>> vectors = new ArrayList<>();
    for (int i = 0; i < response.getEmbeddingsCount(); i++) {
      vectors.add(null);
    }
    for (Embedding e : response.getEmbeddingsList()) {
      vectors.set(e.getIndex(), e.getValuesList());
    }
    return vectors;
  }

  /**
   * An Embed request for texts (tokenized by the server, no special tokens added), pooled as
   * {@code pooling} says: "last" (the default, also for null), "mean" or "cls"; L2-normalised
   * unless {@code normalize} is false.
   */
  public static EmbedRequest embedRequest(String pooling, boolean normalize, List<String> texts) {
    EmbedRequest.Builder request = EmbedRequest.newBuilder();
    for (String text : texts) {
      request.addInputs(EmbedInput.newBuilder().setText(text));
    }
    return request.setPooling(pooling(pooling, normalize)).build();
  }

  /** An Embed request for one token-id input. */
  public static EmbedRequest embedRequest(String pooling, boolean normalize, Iterable<Integer> tokenIds) {
    EmbedInput input = EmbedInput.newBuilder().setTokenIds(TokenIds.newBuilder().addAllIds(tokenIds)).build();
    return EmbedRequest.newBuilder().addInputs(input).setPooling(pooling(pooling, normalize)).build();
  }

  private static PoolingParams pooling(String pooling, boolean normalize) {
    PoolingParams.PoolingType type;
    switch (pooling == null ? "last" : pooling) {
      case "last":
        type = PoolingParams.PoolingType.POOLING_TYPE_LAST;
        break;
      case "mean":
        type = PoolingParams.PoolingType.POOLING_TYPE_MEAN;
        break;
      case "cls":
        type = PoolingParams.PoolingType.POOLING_TYPE_CLS;
        break;
      default:
        throw new IllegalArgumentException("pooling must be last, mean or cls, got " + pooling);
    }
    return PoolingParams.newBuilder().setPoolingType(type).setNormalize(normalize).build();
  }

  /** The model names the server answers to, with the model's limits. */
  public List<ModelCard> listModels() {
    Deadline deadline = deadline();
    return withRetries(
        deadline, () -> blockingStub(deadline).listModels(ListModelsRequest.getDefaultInstance()).getModelsList());
  }

  /** The generated blocking stub (with the API key; no deadline, no retries). */
  public GenerationServiceGrpc.GenerationServiceBlockingStub blockingStub() {
    return blocking;
  }

  /** The generated async stub (with the API key; no deadline, no retries). */
  public GenerationServiceGrpc.GenerationServiceStub asyncStub() {
    return async;
  }

  /** Closes the connection (calls in flight end with CANCELLED or UNAVAILABLE). */
  @Override
  public void close() {
    timer.shutdownNow();
    channel.shutdownNow();
    try {
      channel.awaitTermination(5, TimeUnit.SECONDS);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
  }
}
