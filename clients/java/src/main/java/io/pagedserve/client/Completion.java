package io.pagedserve.client;

import io.pagedserve.v1.FinishReason;
import io.pagedserve.v1.Timings;
import io.pagedserve.v1.ToolCall;
import io.pagedserve.v1.Usage;
import java.util.List;

/** One finished completion: the text and token ids of its chunks and the final message's details. */
public final class Completion {
  public final String requestId;
  public final int index;
  public final FinishReason finishReason;
  /** The stop string that ended it, or "" when none did. */
  public final String stopString;
  public final String text;
  public final List<Integer> tokenIds;
  public final Usage usage;
  public final Timings timings;
  /**
   * The calls the completion made (a request with tools and a tool choice other than none),
   * parsed from {@link #text}: {@code getId()}, {@code getName()}, {@code getArguments()} (JSON
   * text). Send them back in {@link PagedServeClient#assistant} and each result in
   * {@link PagedServeClient#toolResult}.
   */
  public final List<ToolCall> toolCalls;
  /** With tools: the completion's text outside its tool calls. */
  public final String content;

  Completion(
      String requestId,
      int index,
      FinishReason finishReason,
      String stopString,
      String text,
      List<Integer> tokenIds,
      Usage usage,
      Timings timings,
      List<ToolCall> toolCalls,
      String content) {
    this.requestId = requestId;
    this.index = index;
    this.finishReason = finishReason;
    this.stopString = stopString;
    this.text = text;
    this.tokenIds = tokenIds;
    this.usage = usage;
    this.timings = timings;
    this.toolCalls = toolCalls;
    this.content = content;
  }

  /** "stop", "length", "abort", "tool_calls" or "unknown". */
  public String finishReasonName() {
    switch (finishReason) {
      case FINISH_REASON_STOP:
        return "stop";
      case FINISH_REASON_LENGTH:
        return "length";
      case FINISH_REASON_ABORT:
        return "abort";
      case FINISH_REASON_TOOL_CALLS:
        return "tool_calls";
      default:
        return "unknown";
    }
  }

  @Override
  public String toString() {
    return "Completion{index=" + index + ", finish=" + finishReasonName() + ", text=" + text + (toolCalls.isEmpty() ? "" : ", toolCalls=" + toolCalls.size()) + "}";
  }
}
