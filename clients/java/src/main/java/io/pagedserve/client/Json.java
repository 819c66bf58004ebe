package io.pagedserve.client;

import java.util.LinkedHashMap;
import java.util.Map;

/**
 * Just enough JSON for {@link PagedServeClient#toolFromJson}: the members of an object as their
 * raw text (so that a schema is kept exactly as written, its properties in order) and string
 * literals decoded. The client depends on nothing beyond gRPC and protobuf, hence no JSON library.
 */
final class Json {
  private final String text;
  private int pos;

  private Json(String text) {
    this.text = text;
  }

  /** The members of the JSON object {@code text}: name to the raw JSON text of its value, in order. */
  static Map<String, String> members(String text) {
    Json p = new Json(text);
    p.space();
    if (!p.peek('{')) {
      throw p.error("expected a JSON object");
    }
    Map<String, String> out = new LinkedHashMap<>();
    p.pos++;
    p.space();
    if (p.peek('}')) {
      p.pos++;
    } else {
      while (true) {
        p.space();
        String name = p.string();
        p.space();
        p.expect(':');
        p.space();
        int start = p.pos;
        p.value();
        out.put(name, text.substring(start, p.pos));
        p.space();
        if (p.peek(',')) {
          p.pos++;
          continue;
        }
        p.expect('}');
        break;
      }
    }
    p.end();
    return out;
  }

  /** The text of a JSON string literal (raw JSON text, e.g. a value of {@link #members}). */
  static String string(String raw) {
    Json p = new Json(raw);
    p.space();
    if (!p.peek('"')) {
      throw p.error("expected a JSON string");
    }
    String s = p.string();
    p.end();
    return s;
  }

  private IllegalArgumentException error(String what) {
    return new IllegalArgumentException("invalid JSON at character " + pos + ": " + what);
  }

  private boolean peek(char c) {
    return pos < text.length() && text.charAt(pos) == c;
  }

  private void expect(char c) {
    if (!peek(c)) {
      throw error("expected '" + c + "'");
    }
    pos++;
  }

  private void space() {
    while (pos < text.length() && " \t\r\n".indexOf(text.charAt(pos)) >= 0) {
      pos++;
    }
  }

  private void end() {
    space();
    if (pos != text.length()) {
      throw error("unexpected text after the value");
    }
  }

  /** Skips one JSON value, checking it. */
  private void value() {
    if (pos >= text.length()) {
      throw error("unexpected end");
    }
    char c = text.charAt(pos);
    if (c == '{' || c == '[') {
      char close = c == '{' ? '}' : ']';
      pos++;
      space();
      if (peek(close)) {
        pos++;
        return;
      }
      while (true) {
        space();
        if (c == '{') {
          string();
          space();
          expect(':');
          space();
        }
        value();
        space();
        if (peek(',')) {
          pos++;
          continue;
        }
        expect(close);
        return;
      }
    } else if (c == '"') {
      string();
    } else if (text.startsWith("true", pos) || text.startsWith("null", pos)) {
      pos += 4;
    } else if (text.startsWith("false", pos)) {
      pos += 5;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      int start = pos;
      while (pos < text.length() && "+-.eE0123456789".indexOf(text.charAt(pos)) >= 0) {
        pos++;
      }
      if (!text.substring(start, pos).matches("-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?")) {
        throw error("malformed number");
      }
    } else {
      throw error("unexpected '" + c + "'");
    }
  }

  /** Reads one string literal, decoding its escapes. */
  private String string() {
    expect('"');
    StringBuilder b = new StringBuilder();
    while (true) {
      if (pos >= text.length()) {
        throw error("unterminated string");
      }
      char c = text.charAt(pos++);
      if (c == '"') {
        return b.toString();
      }
      if (c < 0x20) {
        throw error("control character in a string");
      }
      if (c != '\\') {
        b.append(c);
        continue;
      }
      if (pos >= text.length()) {
        throw error("unterminated string");
      }
      char e = text.charAt(pos++);
      switch (e) {
        case '"':
        case '\\':
        case '/':
          b.append(e);
          break;
        case 'b':
          b.append('\b');
          break;
        case 'f':
          b.append('\f');
          break;
        case 'n':
          b.append('\n');
          break;
        case 'r':
          b.append('\r');
          break;
        case 't':
          b.append('\t');
          break;
        case 'u':
          if (pos + 4 > text.length() || !text.substring(pos, pos + 4).matches("[0-9a-fA-F]{4}")) {
            throw error("bad \\u escape");
          }
          b.append((char) Integer.parseInt(text.substring(pos, pos + 4), 16));
          pos += 4;
          break;
        default:
          throw error("bad escape \\" + e);
      }
    }
  }
}
