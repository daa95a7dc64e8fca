#include "tests/testing/test_pki.h"

#include <stdlib.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace qtx::testing {

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

const TestPki& TestPki::Get() {
  static const TestPki* pki = new TestPki();
  return *pki;
}

TestPki::TestPki() {
  char tmpl[] = "/tmp/qtx-pki-XXXXXX";
  dir = ::mkdtemp(tmpl);
  const std::string& d = dir;
  WriteFile(d + "/san.ext", "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
  const std::string script = absl::StrCat(
      "set -e; cd ", d, "; exec >openssl.log 2>&1\n",
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=qtx-test-ca "
      "-keyout ca.key -out ca.pem\n",
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=other-ca "
      "-keyout other.key -out other.pem\n",
      "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key "
      "-out server.csr\n",
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
      "-extfile san.ext -out server.pem\n",
      "openssl req -newkey rsa:2048 -nodes -subj /CN=qtx-client -keyout client.key "
      "-out client.csr\n",
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
      "-out client.pem\n");
  WriteFile(d + "/make.sh", script);
  ok_ = std::system(("bash " + d + "/make.sh").c_str()) == 0;
  ca_file = d + "/ca.pem";
  ca_pem = ReadFileOrEmpty(ca_file);
  other_ca_pem = ReadFileOrEmpty(d + "/other.pem");
  server_cert = d + "/server.pem";
  server_key = d + "/server.key";
  client_cert_pem = ReadFileOrEmpty(d + "/client.pem");
  client_key_pem = ReadFileOrEmpty(d + "/client.key");
}

}  // namespace qtx::testing
