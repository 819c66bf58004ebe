package io.pagedserve.v1;

import static io.grpc.MethodDescriptor.generateFullMethodName;

/**
 * <pre>
 * The public API of the control plane. Every call may carry `authorization: Bearer &lt;key&gt;`
 * metadata (required when the server runs with API keys; otherwise UNAUTHENTICATED). Errors
 * are gRPC statuses whose message names the offending field, e.g. INVALID_ARGUMENT
 * "sampling_params.temperature must be &gt;= 0, got -1.0". docs/api.md has the versioning rules
 * and the retry policy of the official clients.
 * </pre>
 */
@javax.annotation.Generated(
    value = "by gRPC proto compiler",
    comments = "Source: pagedserve/v1/generation.proto")
@io.grpc.stub.annotations.GrpcGenerated
public final class GenerationServiceGrpc {

  private GenerationServiceGrpc() {}

  public static final String SERVICE_NAME = "pagedserve.v1.GenerationService";

  // Static method descriptors that strictly reflect the proto.
  private static volatile io.grpc.MethodDescriptor<io.pagedserve.v1.GenerateRequest,
      io.pagedserve.v1.GenerateResponse> getGenerateMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "Generate",
      requestType = io.pagedserve.v1.GenerateRequest.class,
      responseType = io.pagedserve.v1.GenerateResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.SERVER_STREAMING)
  public static io.grpc.MethodDescriptor<io.pagedserve.v1.GenerateRequest,
      io.pagedserve.v1.GenerateResponse> getGenerateMethod() {
    io.grpc.MethodDescriptor<io.pagedserve.v1.GenerateRequest, io.pagedserve.v1.GenerateResponse> getGenerateMethod;
    if ((getGenerateMethod = GenerationServiceGrpc.getGenerateMethod) == null) {
      synchronized (GenerationServiceGrpc.class) {
        if ((getGenerateMethod = GenerationServiceGrpc.getGenerateMethod) == null) {
          GenerationServiceGrpc.getGenerateMethod = getGenerateMethod =
              io.grpc.MethodDescriptor.<io.pagedserve.v1.GenerateRequest, io.pagedserve.v1.GenerateResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.SERVER_STREAMING)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "Generate"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.GenerateRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.GenerateResponse.getDefaultInstance()))
              .setSchemaDescriptor(new GenerationServiceMethodDescriptorSupplier("Generate"))
              .build();
        }
      }
    }
    return getGenerateMethod;
  }

  private static volatile io.grpc.MethodDescriptor<io.pagedserve.v1.TokenizeRequest,
      io.pagedserve.v1.TokenizeResponse> getTokenizeMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "Tokenize",
      requestType = io.pagedserve.v1.TokenizeRequest.class,
      responseType = io.pagedserve.v1.TokenizeResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.UNARY)
  public static io.grpc.MethodDescriptor<io.pagedserve.v1.TokenizeRequest,
      io.pagedserve.v1.TokenizeResponse> getTokenizeMethod() {
    io.grpc.MethodDescriptor<io.pagedserve.v1.TokenizeRequest, io.pagedserve.v1.TokenizeResponse> getTokenizeMethod;
    if ((getTokenizeMethod = GenerationServiceGrpc.getTokenizeMethod) == null) {
      synchronized (GenerationServiceGrpc.class) {
        if ((getTokenizeMethod = GenerationServiceGrpc.getTokenizeMethod) == null) {
          GenerationServiceGrpc.getTokenizeMethod = getTokenizeMethod =
              io.grpc.MethodDescriptor.<io.pagedserve.v1.TokenizeRequest, io.pagedserve.v1.TokenizeResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.UNARY)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "Tokenize"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.TokenizeRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.TokenizeResponse.getDefaultInstance()))
              .setSchemaDescriptor(new GenerationServiceMethodDescriptorSupplier("Tokenize"))
              .build();
        }
      }
    }
    return getTokenizeMethod;
  }

  private static volatile io.grpc.MethodDescriptor<io.pagedserve.v1.DetokenizeRequest,
      io.pagedserve.v1.DetokenizeResponse> getDetokenizeMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "Detokenize",
      requestType = io.pagedserve.v1.DetokenizeRequest.class,
      responseType = io.pagedserve.v1.DetokenizeResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.UNARY)
  public static io.grpc.MethodDescriptor<io.pagedserve.v1.DetokenizeRequest,
      io.pagedserve.v1.DetokenizeResponse> getDetokenizeMethod() {
    io.grpc.MethodDescriptor<io.pagedserve.v1.DetokenizeRequest, io.pagedserve.v1.DetokenizeResponse> getDetokenizeMethod;
    if ((getDetokenizeMethod = GenerationServiceGrpc.getDetokenizeMethod) == null) {
      synchronized (GenerationServiceGrpc.class) {
        if ((getDetokenizeMethod = GenerationServiceGrpc.getDetokenizeMethod) == null) {
          GenerationServiceGrpc.getDetokenizeMethod = getDetokenizeMethod =
              io.grpc.MethodDescriptor.<io.pagedserve.v1.DetokenizeRequest, io.pagedserve.v1.DetokenizeResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.UNARY)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "Detokenize"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.DetokenizeRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.DetokenizeResponse.getDefaultInstance()))
              .setSchemaDescriptor(new GenerationServiceMethodDescriptorSupplier("Detokenize"))
              .build();
        }
      }
    }
    return getDetokenizeMethod;
  }

  private static volatile io.grpc.MethodDescriptor<io.pagedserve.v1.ListModelsRequest,
      io.pagedserve.v1.ListModelsResponse> getListModelsMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "ListModels",
      requestType = io.pagedserve.v1.ListModelsRequest.class,
      responseType = io.pagedserve.v1.ListModelsResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.UNARY)
  public static io.grpc.MethodDescriptor<io.pagedserve.v1.ListModelsRequest,
      io.pagedserve.v1.ListModelsResponse> getListModelsMethod() {
    io.grpc.MethodDescriptor<io.pagedserve.v1.ListModelsRequest, io.pagedserve.v1.ListModelsResponse> getListModelsMethod;
    if ((getListModelsMethod = GenerationServiceGrpc.getListModelsMethod) == null) {
      synchronized (GenerationServiceGrpc.class) {
        if ((getListModelsMethod = GenerationServiceGrpc.getListModelsMethod) == null) {
          GenerationServiceGrpc.getListModelsMethod = getListModelsMethod =
              io.grpc.MethodDescriptor.<io.pagedserve.v1.ListModelsRequest, io.pagedserve.v1.ListModelsResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.UNARY)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "ListModels"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.ListModelsRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.ListModelsResponse.getDefaultInstance()))
              .setSchemaDescriptor(new GenerationServiceMethodDescriptorSupplier("ListModels"))
              .build();
        }
      }
    }
    return getListModelsMethod;
  }

  private static volatile io.grpc.MethodDescriptor<io.pagedserve.v1.EmbedRequest,
      io.pagedserve.v1.EmbedResponse> getEmbedMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "Embed",
      requestType = io.pagedserve.v1.EmbedRequest.class,
      responseType = io.pagedserve.v1.EmbedResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.UNARY)
  public static io.grpc.MethodDescriptor<io.pagedserve.v1.EmbedRequest,
      io.pagedserve.v1.EmbedResponse> getEmbedMethod() {
    io.grpc.MethodDescriptor<io.pagedserve.v1.EmbedRequest, io.pagedserve.v1.EmbedResponse> getEmbedMethod;
    if ((getEmbedMethod = GenerationServiceGrpc.getEmbedMethod) == null) {
      synchronized (GenerationServiceGrpc.class) {
        if ((getEmbedMethod = GenerationServiceGrpc.getEmbedMethod) == null) {
          GenerationServiceGrpc.getEmbedMethod = getEmbedMethod =
              io.grpc.MethodDescriptor.<io.pagedserve.v1.EmbedRequest, io.pagedserve.v1.EmbedResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.UNARY)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "Embed"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.EmbedRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  io.pagedserve.v1.EmbedResponse.getDefaultInstance()))
              .setSchemaDescriptor(new GenerationServiceMethodDescriptorSupplier("Embed"))
              .build();
        }
      }
    }
    return getEmbedMethod;
  }

  /**
   * Creates a new async stub that supports all call types for the service
   */
  public static GenerationServiceStub newStub(io.grpc.Channel channel) {
    io.grpc.stub.AbstractStub.StubFactory<GenerationServiceStub> factory =
      new io.grpc.stub.AbstractStub.StubFactory<GenerationServiceStub>() {
        @java.lang.Override
        public GenerationServiceStub newStub(io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
          return new GenerationServiceStub(channel, callOptions);
        }
      };
    return GenerationServiceStub.newStub(factory, channel);
  }

  /**
   * Creates a new blocking-style stub that supports unary and streaming output calls on the service
   */
  public static GenerationServiceBlockingStub newBlockingStub(
      io.grpc.Channel channel) {
    io.grpc.stub.AbstractStub.StubFactory<GenerationServiceBlockingStub> factory =
      new io.grpc.stub.AbstractStub.StubFactory<GenerationServiceBlockingStub>() {
        @java.lang.Override
        public GenerationServiceBlockingStub newStub(io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
          return new GenerationServiceBlockingStub(channel, callOptions);
        }
      };
    return GenerationServiceBlockingStub.newStub(factory, channel);
  }

  /**
   * Creates a new ListenableFuture-style stub that supports unary calls on the service
   */
  public static GenerationServiceFutureStub newFutureStub(
      io.grpc.Channel channel) {
    io.grpc.stub.AbstractStub.StubFactory<GenerationServiceFutureStub> factory =
      new io.grpc.stub.AbstractStub.StubFactory<GenerationServiceFutureStub>() {
        @java.lang.Override
        public GenerationServiceFutureStub newStub(io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
          return new GenerationServiceFutureStub(channel, callOptions);
        }
      };
    return GenerationServiceFutureStub.newStub(factory, channel);
  }

  /**
   * <pre>
   * The public API of the control plane. Every call may carry `authorization: Bearer &lt;key&gt;`
   * metadata (required when the server runs with API keys; otherwise UNAUTHENTICATED). Errors
   * are gRPC statuses whose message names the offending field, e.g. INVALID_ARGUMENT
   * "sampling_params.temperature must be &gt;= 0, got -1.0". docs/api.md has the versioning rules
   * and the retry policy of the official clients.
   * </pre>
   */
  public static abstract class GenerationServiceImplBase implements io.grpc.BindableService {

    /**
     * <pre>
     * Streams the completion as token ids and text deltas, then one final message per
     * completion index. The call's gRPC deadline bounds queueing and generation; cancelling
     * the call aborts the request and frees its KV blocks. RESOURCE_EXHAUSTED (admission queue
     * full) carries a `retry-after` trailer in seconds; UNAVAILABLE before the first message
     * means no data plane could take the request, after it that the stream broke.
     * </pre>
     */
    public void generate(io.pagedserve.v1.GenerateRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.GenerateResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getGenerateMethod(), responseObserver);
    }

    /**
     * <pre>
     * The prompt token ids the server would generate from (chat prompts rendered with the
     * model's chat template, generation prompt appended).
     * </pre>
     */
    public void tokenize(io.pagedserve.v1.TokenizeRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.TokenizeResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getTokenizeMethod(), responseObserver);
    }

    /**
     * <pre>
     * The text of a list of token ids (special tokens skipped).
     * </pre>
     */
    public void detokenize(io.pagedserve.v1.DetokenizeRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.DetokenizeResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getDetokenizeMethod(), responseObserver);
    }

    /**
     * <pre>
     * The model names this server answers to and the served model's limits.
     * </pre>
     */
    public void listModels(io.pagedserve.v1.ListModelsRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.ListModelsResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getListModelsMethod(), responseObserver);
    }

    /**
     * <pre>
     * One embedding per input: each input's prompt is computed (prefill only, nothing
     * generated, its KV blocks freed at once) and its final hidden states pooled. At most 256
     * inputs, each of 1 to max_model_len tokens; else INVALID_ARGUMENT naming the field
     * (e.g. `inputs[3].token_ids`). The call's deadline, API key and tenant limits apply as
     * for Generate.
     * </pre>
     */
    public void embed(io.pagedserve.v1.EmbedRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.EmbedResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getEmbedMethod(), responseObserver);
    }

    @java.lang.Override public final io.grpc.ServerServiceDefinition bindService() {
      return io.grpc.ServerServiceDefinition.builder(getServiceDescriptor())
          .addMethod(
            getGenerateMethod(),
            io.grpc.stub.ServerCalls.asyncServerStreamingCall(
              new MethodHandlers<
                io.pagedserve.v1.GenerateRequest,
                io.pagedserve.v1.GenerateResponse>(
                  this, METHODID_GENERATE)))
          .addMethod(
            getTokenizeMethod(),
            io.grpc.stub.ServerCalls.asyncUnaryCall(
              new MethodHandlers<
                io.pagedserve.v1.TokenizeRequest,
                io.pagedserve.v1.TokenizeResponse>(
                  this, METHODID_TOKENIZE)))
          .addMethod(
            getDetokenizeMethod(),
            io.grpc.stub.ServerCalls.asyncUnaryCall(
              new MethodHandlers<
                io.pagedserve.v1.DetokenizeRequest,
                io.pagedserve.v1.DetokenizeResponse>(
                  this, METHODID_DETOKENIZE)))
          .addMethod(
            getListModelsMethod(),
            io.grpc.stub.ServerCalls.asyncUnaryCall(
              new MethodHandlers<
                io.pagedserve.v1.ListModelsRequest,
                io.pagedserve.v1.ListModelsResponse>(
                  this, METHODID_LIST_MODELS)))
          .addMethod(
            getEmbedMethod(),
            io.grpc.stub.ServerCalls.asyncUnaryCall(
              new MethodHandlers<
                io.pagedserve.v1.EmbedRequest,
                io.pagedserve.v1.EmbedResponse>(
                  this, METHODID_EMBED)))
          .build();
    }
  }

  /**
   * <pre>
   * The public API of the control plane. Every call may carry `authorization: Bearer &lt;key&gt;`
   * metadata (required when the server runs with API keys; otherwise UNAUTHENTICATED). Errors
   * are gRPC statuses whose message names the offending field, e.g. INVALID_ARGUMENT
   * "sampling_params.temperature must be &gt;= 0, got -1.0". docs/api.md has the versioning rules
   * and the retry policy of the official clients.
   * </pre>
   */
  public static final class GenerationServiceStub extends io.grpc.stub.AbstractAsyncStub<GenerationServiceStub> {
    private GenerationServiceStub(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      super(channel, callOptions);
    }

    @java.lang.Override
    protected GenerationServiceStub build(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      return new GenerationServiceStub(channel, callOptions);
    }

    /**
     * <pre>
     * Streams the completion as token ids and text deltas, then one final message per
     * completion index. The call's gRPC deadline bounds queueing and generation; cancelling
     * the call aborts the request and frees its KV blocks. RESOURCE_EXHAUSTED (admission queue
     * full) carries a `retry-after` trailer in seconds; UNAVAILABLE before the first message
     * means no data plane could take the request, after it that the stream broke.
     * </pre>
     */
    public void generate(io.pagedserve.v1.GenerateRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.GenerateResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncServerStreamingCall(
          getChannel().newCall(getGenerateMethod(), getCallOptions()), request, responseObserver);
    }

    /**
     * <pre>
     * The prompt token ids the server would generate from (chat prompts rendered with the
     * model's chat template, generation prompt appended).
     * </pre>
     */
    public void tokenize(io.pagedserve.v1.TokenizeRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.TokenizeResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncUnaryCall(
          getChannel().newCall(getTokenizeMethod(), getCallOptions()), request, responseObserver);
    }

    /**
     * <pre>
     * The text of a list of token ids (special tokens skipped).
     * </pre>
     */
    public void detokenize(io.pagedserve.v1.DetokenizeRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.DetokenizeResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncUnaryCall(
          getChannel().newCall(getDetokenizeMethod(), getCallOptions()), request, responseObserver);
    }

    /**
     * <pre>
     * The model names this server answers to and the served model's limits.
     * </pre>
     */
    public void listModels(io.pagedserve.v1.ListModelsRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.ListModelsResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncUnaryCall(
          getChannel().newCall(getListModelsMethod(), getCallOptions()), request, responseObserver);
    }

    /**
     * <pre>
     * One embedding per input: each input's prompt is computed (prefill only, nothing
     * generated, its KV blocks freed at once) and its final hidden states pooled. At most 256
     * inputs, each of 1 to max_model_len tokens; else INVALID_ARGUMENT naming the field
     * (e.g. `inputs[3].token_ids`). The call's deadline, API key and tenant limits apply as
     * for Generate.
     * </pre>
     */
    public void embed(io.pagedserve.v1.EmbedRequest request,
        io.grpc.stub.StreamObserver<io.pagedserve.v1.EmbedResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncUnaryCall(
          getChannel().newCall(getEmbedMethod(), getCallOptions()), request, responseObserver);
    }
  }

  /**
   * <pre>
   * The public API of the control plane. Every call may carry `authorization: Bearer &lt;key&gt;`
   * metadata (required when the server runs with API keys; otherwise UNAUTHENTICATED). Errors
   * are gRPC statuses whose message names the offending field, e.g. INVALID_ARGUMENT
   * "sampling_params.temperature must be &gt;= 0, got -1.0". docs/api.md has the versioning rules
   * and the retry policy of the official clients.
   * </pre>
   */
  public static final class GenerationServiceBlockingStub extends io.grpc.stub.AbstractBlockingStub<GenerationServiceBlockingStub> {
    private GenerationServiceBlockingStub(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      super(channel, callOptions);
    }

    @java.lang.Override
    protected GenerationServiceBlockingStub build(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      return new GenerationServiceBlockingStub(channel, callOptions);
    }

    /**
     * <pre>
     * Streams the completion as token ids and text deltas, then one final message per
     * completion index. The call's gRPC deadline bounds queueing and generation; cancelling
     * the call aborts the request and frees its KV blocks. RESOURCE_EXHAUSTED (admission queue
     * full) carries a `retry-after` trailer in seconds; UNAVAILABLE before the first message
     * means no data plane could take the request, after it that the stream broke.
     * </pre>
     */
    public java.util.Iterator<io.pagedserve.v1.GenerateResponse> generate(
        io.pagedserve.v1.GenerateRequest request) {
      return io.grpc.stub.ClientCalls.blockingServerStreamingCall(
          getChannel(), getGenerateMethod(), getCallOptions(), request);
    }

    /**
     * <pre>
     * The prompt token ids the server would generate from (chat prompts rendered with the
     * model's chat template, generation prompt appended).
     * </pre>
     */
    public io.pagedserve.v1.TokenizeResponse tokenize(io.pagedserve.v1.TokenizeRequest request) {
      return io.grpc.stub.ClientCalls.blockingUnaryCall(
          getChannel(), getTokenizeMethod(), getCallOptions(), request);
    }

    /**
     * <pre>
     * The text of a list of token ids (special tokens skipped).
     * </pre>
     */
    public io.pagedserve.v1.DetokenizeResponse detokenize(io.pagedserve.v1.DetokenizeRequest request) {
      return io.grpc.stub.ClientCalls.blockingUnaryCall(
          getChannel(), getDetokenizeMethod(), getCallOptions(), request);
    }

    /**
     * <pre>
     * The model names this server answers to and the served model's limits.
     * </pre>
     */
    public io.pagedserve.v1.ListModelsResponse listModels(io.pagedserve.v1.ListModelsRequest request) {
      return io.grpc.stub.ClientCalls.blockingUnaryCall(
          getChannel(), getListModelsMethod(), getCallOptions(), request);
    }

    /**
     * <pre>
     * One embedding per input: each input's prompt is computed (prefill only, nothing
     * generated, its KV blocks freed at once) and its final hidden states pooled. At most 256
     * inputs, each of 1 to max_model_len tokens; else INVALID_ARGUMENT naming the field
     * (e.g. `inputs[3].token_ids`). The call's deadline, API key and tenant limits apply as
     * for Generate.
     * </pre>
     */
    public io.pagedserve.v1.EmbedResponse embed(io.pagedserve.v1.EmbedRequest request) {
      return io.grpc.stub.ClientCalls.blockingUnaryCall(
          getChannel(), getEmbedMethod(), getCallOptions(), request);
    }
  }

  /**
   * <pre>
   * The public API of the control plane. Every call may carry `authorization: Bearer &lt;key&gt;`
   * metadata (required when the server runs with API keys; otherwise UNAUTHENTICATED). Errors
   * are gRPC statuses whose message names the offending field, e.g. INVALID_ARGUMENT
   * "sampling_params.temperature must be &gt;= 0, got -1.0". docs/api.md has the versioning rules
   * and the retry policy of the official clients.
   * </pre>
   */
  public static final class GenerationServiceFutureStub extends io.grpc.stub.AbstractFutureStub<GenerationServiceFutureStub> {
    private GenerationServiceFutureStub(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      super(channel, callOptions);
    }

    @java.lang.Override
    protected GenerationServiceFutureStub build(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      return new GenerationServiceFutureStub(channel, callOptions);
    }

    /**
     * <pre>
     * The prompt token ids the server would generate from (chat prompts rendered with the
     * model's chat template, generation prompt appended).
     * </pre>
     */
    public com.google.common.util.concurrent.ListenableFuture<io.pagedserve.v1.TokenizeResponse> tokenize(
        io.pagedserve.v1.TokenizeRequest request) {
      return io.grpc.stub.ClientCalls.futureUnaryCall(
          getChannel().newCall(getTokenizeMethod(), getCallOptions()), request);
    }

    /**
     * <pre>
     * The text of a list of token ids (special tokens skipped).
     * </pre>
     */
    public com.google.common.util.concurrent.ListenableFuture<io.pagedserve.v1.DetokenizeResponse> detokenize(
        io.pagedserve.v1.DetokenizeRequest request) {
      return io.grpc.stub.ClientCalls.futureUnaryCall(
          getChannel().newCall(getDetokenizeMethod(), getCallOptions()), request);
    }

    /**
     * <pre>
     * The model names this server answers to and the served model's limits.
     * </pre>
     */
    public com.google.common.util.concurrent.ListenableFuture<io.pagedserve.v1.ListModelsResponse> listModels(
        io.pagedserve.v1.ListModelsRequest request) {
      return io.grpc.stub.ClientCalls.futureUnaryCall(
          getChannel().newCall(getListModelsMethod(), getCallOptions()), request);
    }

    /**
     * <pre>
     * One embedding per input: each input's prompt is computed (prefill only, nothing
     * generated, its KV blocks freed at once) and its final hidden states pooled. At most 256
     * inputs, each of 1 to max_model_len tokens; else INVALID_ARGUMENT naming the field
     * (e.g. `inputs[3].token_ids`). The call's deadline, API key and tenant limits apply as
     * for Generate.
     * </pre>
     */
    public com.google.common.util.concurrent.ListenableFuture<io.pagedserve.v1.EmbedResponse> embed(
        io.pagedserve.v1.EmbedRequest request) {
      return io.grpc.stub.ClientCalls.futureUnaryCall(
          getChannel().newCall(getEmbedMethod(), getCallOptions()), request);
    }
  }

  private static final int METHODID_GENERATE = 0;
  private static final int METHODID_TOKENIZE = 1;
  private static final int METHODID_DETOKENIZE = 2;
  private static final int METHODID_LIST_MODELS = 3;
  private static final int METHODID_EMBED = 4;

  private static final class MethodHandlers<Req, Resp> implements
      io.grpc.stub.ServerCalls.UnaryMethod<Req, Resp>,
      io.grpc.stub.ServerCalls.ServerStreamingMethod<Req, Resp>,
      io.grpc.stub.ServerCalls.ClientStreamingMethod<Req, Resp>,
      io.grpc.stub.ServerCalls.BidiStreamingMethod<Req, Resp> {
    private final GenerationServiceImplBase serviceImpl;
    private final int methodId;

    MethodHandlers(GenerationServiceImplBase serviceImpl, int methodId) {
      this.serviceImpl = serviceImpl;
      this.methodId = methodId;
    }

    @java.lang.Override
    @java.lang.SuppressWarnings("unchecked")
    public void invoke(Req request, io.grpc.stub.StreamObserver<Resp> responseObserver) {
      switch (methodId) {
        case METHODID_GENERATE:
          serviceImpl.generate((io.pagedserve.v1.GenerateRequest) request,
              (io.grpc.stub.StreamObserver<io.pagedserve.v1.GenerateResponse>) responseObserver);
          break;
        case METHODID_TOKENIZE:
          serviceImpl.tokenize((io.pagedserve.v1.TokenizeRequest) request,
              (io.grpc.stub.StreamObserver<io.pagedserve.v1.TokenizeResponse>) responseObserver);
          break;
        case METHODID_DETOKENIZE:
          serviceImpl.detokenize((io.pagedserve.v1.DetokenizeRequest) request,
              (io.grpc.stub.StreamObserver<io.pagedserve.v1.DetokenizeResponse>) responseObserver);
          break;
        case METHODID_LIST_MODELS:
          serviceImpl.listModels((io.pagedserve.v1.ListModelsRequest) request,
              (io.grpc.stub.StreamObserver<io.pagedserve.v1.ListModelsResponse>) responseObserver);
          break;
        case METHODID_EMBED:
          serviceImpl.embed((io.pagedserve.v1.EmbedRequest) request,
              (io.grpc.stub.StreamObserver<io.pagedserve.v1.EmbedResponse>) responseObserver);
          break;
        default:
          throw new AssertionError();
      }
    }

    @java.lang.Override
    @java.lang.SuppressWarnings("unchecked")
    public io.grpc.stub.StreamObserver<Req> invoke(
        io.grpc.stub.StreamObserver<Resp> responseObserver) {
      switch (methodId) {
        default:
          throw new AssertionError();
      }
    }
  }

  private static abstract class GenerationServiceBaseDescriptorSupplier
      implements io.grpc.protobuf.ProtoFileDescriptorSupplier, io.grpc.protobuf.ProtoServiceDescriptorSupplier {
    GenerationServiceBaseDescriptorSupplier() {}

    @java.lang.Override
    public com.google.protobuf.Descriptors.FileDescriptor getFileDescriptor() {
      return io.pagedserve.v1.Generation.getDescriptor();
    }

    @java.lang.Override
    public com.google.protobuf.Descriptors.ServiceDescriptor getServiceDescriptor() {
      return getFileDescriptor().findServiceByName("GenerationService");
    }
  }

  private static final class GenerationServiceFileDescriptorSupplier
      extends GenerationServiceBaseDescriptorSupplier {
    GenerationServiceFileDescriptorSupplier() {}
  }

  private static final class GenerationServiceMethodDescriptorSupplier
      extends GenerationServiceBaseDescriptorSupplier
      implements io.grpc.protobuf.ProtoMethodDescriptorSupplier {
    private final String methodName;

    GenerationServiceMethodDescriptorSupplier(String methodName) {
      this.methodName = methodName;
    }

    @java.lang.Override
    public com.google.protobuf.Descriptors.MethodDescriptor getMethodDescriptor() {
      return getServiceDescriptor().findMethodByName(methodName);
    }
  }

  private static volatile io.grpc.ServiceDescriptor serviceDescriptor;

  public static io.grpc.ServiceDescriptor getServiceDescriptor() {
    io.grpc.ServiceDescriptor result = serviceDescriptor;
    if (result == null) {
      synchronized (GenerationServiceGrpc.class) {
        result = serviceDescriptor;
        if (result == null) {
          serviceDescriptor = result = io.grpc.ServiceDescriptor.newBuilder(SERVICE_NAME)
              .setSchemaDescriptor(new GenerationServiceFileDescriptorSupplier())
              .addMethod(getGenerateMethod())
              .addMethod(getTokenizeMethod())
              .addMethod(getDetokenizeMethod())
              .addMethod(getListModelsMethod())
              .addMethod(getEmbedMethod())
              .build();
        }
      }
    }
    return result;
  }
}
