// TestPki: throwaway X.509 material for TLS tests, made once per process by
// the openssl command in a temporary directory: a CA, a server certificate
// for localhost / 127.0.0.1 and a client certificate (both signed by the CA),
// and a second, unrelated CA. Immutable after Get(); safe to share.
#ifndef QTX_TESTS_TESTING_TEST_PKI_H_
#define QTX_TESTS_TESTING_TEST_PKI_H_

#include <string>

namespace qtx::testing {

std::string ReadFileOrEmpty(const std::string& path);
void WriteFile(const std::string& path, const std::string& text);

class TestPki {
 public:
  static const TestPki& Get();

  // False when openssl failed; see `dir`/openssl.log.
  bool ok() const { return ok_; }

  std::string dir;
  std::string ca_pem, ca_file, other_ca_pem;    // CA: contents and file
  std::string server_cert, server_key;          // files
  std::string client_cert_pem, client_key_pem;  // contents

 private:
  TestPki();
  bool ok_ = false;
};

}  // namespace qtx::testing

#endif  // QTX_TESTS_TESTING_TEST_PKI_H_
